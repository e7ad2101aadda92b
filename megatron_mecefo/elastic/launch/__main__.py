"""`python -m megatron_mecefo.elastic.launch`: the same as `mecefo-launch`."""

import sys

from megatron_mecefo.elastic.launch.cli import main

sys.exit(main())
