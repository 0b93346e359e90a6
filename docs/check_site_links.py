"""Checks a built documentation site for dead relative links.

    python docs/check_site_links.py SITE_DIR

Every relative `href` and `src` of every HTML page must name a file of the
site (a folder's `index.html` counts); links to other hosts and to anchors of
the same page are not checked here (`mkdocs build --strict` checks anchors).
Exits 1 and lists the dead links if there are any.
"""

from __future__ import annotations

import pathlib
import re
import sys
from urllib.parse import unquote
from urllib.parse import urlsplit

_LINK = re.compile(r'(?:href|src)="([^"]+)"')


def dead_links(site: pathlib.Path) -> list[str]:
    dead = []
    for page in sorted(site.rglob("*.html")):
        for target in _LINK.findall(page.read_text(errors="replace")):
            parts = urlsplit(target)
            if parts.scheme or parts.netloc or not parts.path:
                continue
            # Root-relative links (the 404 page's) start at the site's root.
            base = site if parts.path.startswith("/") else page.parent
            path = (base / unquote(parts.path).lstrip("/")).resolve()
            if path.is_dir():
                path = path / "index.html"
            if not path.exists():
                dead.append(f"{page.relative_to(site)}: {target}")
    return dead


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    dead = dead_links(pathlib.Path(argv[0]))
    for line in dead:
        print(line)
    print(f"{len(dead)} dead relative links")
    return 1 if dead else 0


if __name__ == "__main__":
    sys.exit(main())
