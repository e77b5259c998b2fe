"""``python -m megatron_tlt.config [--markdown]``: print the field reference."""

import sys

from .markdown import describe

print(describe(markdown="--markdown" in sys.argv[1:]))
