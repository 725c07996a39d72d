"""Regenerate docs/_static/summary.png, the README's screenshot of a real summary.

Executes docs/walkthroughs/leaks.md (a MyST notebook) in a real kernel, takes the HTML summary the
last ``%%tensorscope`` cell displayed (its sections open), renders it alone in headless Chromium and keeps the top of it as a
small palette PNG:

    python tools/docs_screenshot.py [--out docs/_static/summary.png] [--height 1100]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def summary_html(notebook: Path) -> str:
    from myst_nb.core.read import read_myst_markdown_notebook
    from nbclient import NotebookClient

    nb = read_myst_markdown_notebook(notebook.read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as work:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": work}}).execute()
    for cell in reversed(nb.cells):   # the last summary: a warm cell (the first one pays one-time set-up)
        if cell.cell_type == "code" and cell.source.lstrip().startswith("%%tensorscope"):
            for out in cell.get("outputs", []):
                page = out.get("data", {}).get("text/html")
                if page:
                    return page.replace("<details>", "<details open>")   # its sections shown, not collapsed
    raise SystemExit(f"{notebook}: no %%tensorscope cell displayed an HTML summary")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--notebook", default=str(ROOT / "docs" / "walkthroughs" / "leaks.md"))
    p.add_argument("--out", default=str(ROOT / "docs" / "_static" / "summary.png"))
    p.add_argument("--width", type=int, default=1000)
    p.add_argument("--height", type=int, default=1100)
    a = p.parse_args(argv)
    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if chromium is None:
        raise SystemExit("needs Chromium (Debian: apt-get install chromium)")
    body = summary_html(Path(a.notebook))
    with tempfile.TemporaryDirectory() as d:
        page = Path(d) / "summary.html"
        page.write_text("<!doctype html><meta charset=utf-8><body style='margin:16px;background:#fff;"
                        "font-family:sans-serif'>" + body + "</body>", encoding="utf-8")
        shot = Path(d) / "shot.png"
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--proxy-server=127.0.0.1:9", f"--window-size={a.width},{a.height}",
                        f"--screenshot={shot}", page.as_uri()], check=True, capture_output=True, timeout=120)
        from PIL import Image

        with Image.open(shot) as im:
            im.convert("RGB").quantize(colors=64).save(a.out, optimize=True)
    print(f"{a.out}: {os.path.getsize(a.out) // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
