"""Imports `specrouter` from the checkout named by SPECROUTER_AB_TREE (`loadtest.ab`).

`python -m specrouter` puts the working directory first on `sys.path`, ahead of
PYTHONPATH, after this module runs: importing the package here, from the tree, makes it
the one every later `import specrouter...` finds."""

import os
import sys

_tree = os.environ.get("SPECROUTER_AB_TREE")
if _tree:
    sys.path.insert(0, _tree)
    try:
        import specrouter  # noqa: F401
    finally:
        sys.path.remove(_tree)
