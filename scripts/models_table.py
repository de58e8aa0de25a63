"""Regenerate docs/models.md: every decoder family of the installed transformers under
varlen_packed (supported / refused and why), from the checks in tests/model_families.py.

    PYTHONPATH=$PWD python scripts/models_table.py            # all families (~10-20 min CPU)
    PYTHONPATH=$PWD python scripts/models_table.py --check    # exit 1 if the page is stale

tests/models/test_all_families.py (marked slow) runs the same checks and compares with the page.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import model_families  # noqa: E402

PAGE = ROOT / "docs" / "models.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    parser.add_argument("--verbose", action="store_true", help="print each family as it runs")
    args = parser.parse_args(argv)
    outcomes = []
    for family in model_families.families():
        outcomes.append(model_families.outcome(family))
        if args.verbose:
            o = outcomes[-1]
            print(f"{o.family}: {o.status} {o.reason}", flush=True)
    text = model_families.render(outcomes)
    if args.check:
        stale = not PAGE.exists() or PAGE.read_text(encoding="utf-8") != text
        print(f"{PAGE} is {'stale' if stale else 'up to date'}")
        return 1 if stale else 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE} ({len(outcomes)} families)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
