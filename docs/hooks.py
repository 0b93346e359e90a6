"""MkDocs hooks: links from the documentation to the repository's other files.

The guides and reports link to files outside `docs/` (the README, examples/,
research/): results, scripts, figures. The site holds only `docs/`, so
`on_page_content` rewrites each such link that names an existing file of the
repository to a copy under `_repository/` in the site, and `on_post_build`
copies those files there. `docs/check_site_links.py` checks that the built
site has no dead relative link.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
from urllib.parse import urlsplit

# Paths relative to the repository root, of the files the site must copy.
_COPIED: set[str] = set()
_LINK = re.compile(r'(?P<attribute>href|src)="(?P<target>[^"]+)"')
FOLDER = "_repository"


def _repository_root(config):
    return os.path.dirname(os.path.abspath(config.config_file_path))


def on_page_content(html, page, config, files):
    root = _repository_root(config)
    docs = os.path.abspath(config.docs_dir)
    source_folder = os.path.dirname(page.file.abs_src_path)
    # Pages are folders (`reports/cifar10/`), the home page is the root ("").
    page_folder = page.url.rstrip("/") if page.url.endswith("/") else posixpath.dirname(page.url)

    def rewrite(match):
        target = match.group("target")
        parts = urlsplit(target)
        if parts.scheme or parts.netloc or not parts.path or target.startswith("/"):
            return match.group(0)
        path = os.path.normpath(os.path.join(source_folder, parts.path))
        inside_docs = os.path.commonpath([path, docs]) == docs
        inside_repository = os.path.commonpath([path, root]) == root
        if inside_docs or not inside_repository or not os.path.exists(path):
            return match.group(0)
        relative = os.path.relpath(path, root).replace(os.sep, "/")
        _COPIED.add(relative)
        url = posixpath.relpath(f"{FOLDER}/{relative}", page_folder or ".")
        if os.path.isdir(path):
            url += "/index.html"
        if parts.fragment:
            url += "#" + parts.fragment
        return f'{match.group("attribute")}="{url}"'

    return _LINK.sub(rewrite, html)


def on_post_build(config):
    root = _repository_root(config)
    for relative in sorted(_COPIED):
        source = os.path.join(root, relative)
        destination = os.path.join(config.site_dir, FOLDER, relative)
        if os.path.isdir(source):
            _copy_folder(source, destination, relative)
        else:
            os.makedirs(os.path.dirname(destination), exist_ok=True)
            shutil.copyfile(source, destination)


def _copy_folder(source, destination, relative):
    """A linked folder: its files, and an `index.html` that lists them."""
    shutil.copytree(
        source,
        destination,
        dirs_exist_ok=True,
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    names = sorted(
        os.path.relpath(os.path.join(folder, name), destination).replace(os.sep, "/")
        for folder, _, found in os.walk(destination)
        for name in found
        if name != "index.html"
    )
    items = "".join(f'<li><a href="{name}">{name}</a></li>' for name in names)
    with open(os.path.join(destination, "index.html"), "w") as file:
        file.write(f"<html><body><h1>{relative}/</h1><ul>{items}</ul></body></html>")
