"""Print (or, with --write, put into README.md) the configuration reference generated from the
docstrings of MeCeFOConfig's fields: the one source of the README table and the `--help` text."""

import argparse
import re
from pathlib import Path

from megatron_mecefo.config import reference_table

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- config-reference:[^\n]*-->\n).*?(\n<!-- /config-reference -->)", re.S)


def readme_with_table(text: str) -> str:
    if not BLOCK.search(text):
        raise SystemExit("README.md has no <!-- config-reference: ... --> block")
    return BLOCK.sub(lambda m: m.group(1) + reference_table() + m.group(2), text)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--write", action="store_true", help="rewrite the block in README.md")
    if p.parse_args().write:
        README.write_text(readme_with_table(README.read_text()))
    else:
        print(reference_table())
