"""Old module paths of hf_varlen that moved, kept for one release.

Each old path (``hf_varlen.integrations.loss``, ``.trl``, ...) is a two-line
module that calls ``moved``: importing it warns once and makes the old name the new module itself
(``sys.modules``), so private names and ``monkeypatch.setattr`` on the old path keep acting on the
code that runs, which a ``from new import *`` copy would not.
"""

from __future__ import annotations

import importlib
import sys
import warnings


def moved(old: str, new: str) -> None:
    """Make module ``old`` an alias of ``new`` (both absolute) and warn that ``old`` is going."""
    warnings.warn(
        f"{old} has moved to {new}; the old path is removed in the next release",
        DeprecationWarning,
        stacklevel=3,  # the importer: warnings skips the import machinery's frames
    )
    sys.modules[old] = importlib.import_module(new)
