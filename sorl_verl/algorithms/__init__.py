"""The SORL algorithms in torch: turn segmentation, policy losses, advantage estimators, their knobs
and config, the update-scaled optimizer.

This package imports verl first. verl loads the plugin, whose algorithms section imports the
losses and the estimators; had a process imported one of those modules first, its own import of
verl would have run the plugin while it was half-defined (and left the SORL losses unregistered).
Importing verl here, before any module of the package, makes the order the same whichever module
a process imports first.
"""

import verl  # noqa: F401 - first, see above
