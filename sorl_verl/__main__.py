"""``python -m sorl_verl <command>``: the ``sorl-verl`` command of :mod:`sorl_verl.cli`
(``main`` is also the console script's entry point, ``sorl_verl.__main__:main``)."""

import sys

from sorl_verl.cli import main

if __name__ == "__main__":
    sys.exit(main())
