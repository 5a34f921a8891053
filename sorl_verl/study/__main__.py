"""``python -m sorl_verl.study`` (see :mod:`sorl_verl.study.cli`)."""

import sys

from sorl_verl.study.cli import main

if __name__ == "__main__":
    sys.exit(main())
