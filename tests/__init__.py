"""The test suite: `make test`, or `python -m pytest` from the repository root."""

import os
import sys

# The repository root holds folders named like other installed packages (kernels/ is also
# Hugging Face's `kernels`, which transformers imports). tierkv is reached through its
# install, so the root moves to the end of sys.path, where only this package is looked up.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _ROOT] + [_ROOT]
