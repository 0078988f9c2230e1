"""The vision tier runs in the second environment (`make test` runs it with `.venv-vision`, where
PyPI's torchvision imports beside PyPI's torch): in an environment without torchvision these files
are not collected."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("torchvision") else ["test_*.py"]
