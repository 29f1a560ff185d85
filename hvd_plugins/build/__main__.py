"""``python -m hvd_plugins.build``: the same as ``hvd-build-horovod``."""

import sys

from hvd_plugins.build import main

sys.exit(main())
