"""``python -m deepinfer.gateway``."""

import sys

from deepinfer.gateway.service import main

sys.exit(main())
