"""The report's layout in a real browser: headless chromium (the Debian package) lays out a
report at several window widths, and no two of its boxes (sections, headings, paragraphs,
tables, figures, the summary's columns) may overlap, none may reach past the viewport, and none
may hold text that spills out of it (e.g. a long model path beside another table). The page
itself carries no script: a copy gets one that measures the boxes once the page has loaded and
writes its verdict into the DOM, which `chromium --dump-dom` prints."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeline.check.report_sources import read_shards_manifest
from pipeline.cli import main
from tests.helpers import current_manifest, rewrite_manifest
from tests.trainer_fixtures import write_checkpoint

WIDTHS = (600, 900, 1200, 1600)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# A model given by its path in a local cache, ending in a run of 66 characters with no break
# opportunity (a snapshot hash): wider than half the page, as no word of the report is.
LONG_MODEL = (
    "/mnt/shared/model-cache/huggingface/hub/models--sentence-transformers--all-MiniLM-L6-v2/snapshots/"
    "c9745ed1d9f207416be6d2e6f8de32d1f16199bfc9745ed1d9f207416be6d2e6f8"
)

MEASURE = """<script>
window.addEventListener("load", () => {
  const view = document.documentElement.clientWidth;
  const boxes = [...document.querySelectorAll(
    "h1, nav, section, h2, h3, p, table, img, .columns > div, .sample")];
  const cells = [...document.querySelectorAll("td, th")];
  const name = (el) => {
    const where = el.closest("section");
    let head = el.previousElementSibling;  // the heading a table or figure comes under
    while (head && !/^H[1-3]$/.test(head.tagName)) head = head.previousElementSibling;
    const under = head && el.tagName !== "SECTION" ? ` under "${head.innerText.trim()}"` : "";
    const text = (el.innerText || el.alt || "").trim().replace(/\\s+/g, " ").slice(0, 40);
    return `${el.tagName.toLowerCase()} in #${where ? where.id : "top"}${under} "${text}"`;
  };
  const r = (el) => el.getBoundingClientRect();
  const px = (x) => Math.round(x);
  const problems = [];
  if (document.documentElement.scrollWidth > view + 1)
    problems.push(`the page scrolls sideways: ${document.documentElement.scrollWidth} px wide in ${view}`);
  for (const el of boxes) {
    const b = r(el);
    if (b.left < -1 || b.right > view + 1)
      problems.push(`${name(el)} spans x ${px(b.left)}..${px(b.right)}, past the viewport (0..${view})`);
  }
  for (const el of boxes.concat(cells)) {
    if (el.tagName !== "IMG" && el.scrollWidth > el.clientWidth + 1)
      problems.push(`${name(el)} holds content ${el.scrollWidth} px wide in ${el.clientWidth} px`);
  }
  for (let i = 0; i < boxes.length; i++) {
    for (let j = i + 1; j < boxes.length; j++) {
      const a = boxes[i], b = boxes[j];
      if (a.contains(b) || b.contains(a)) continue;
      const p = r(a), q = r(b);
      const w = Math.min(p.right, q.right) - Math.max(p.left, q.left);
      const h = Math.min(p.bottom, q.bottom) - Math.max(p.top, q.top);
      if (w > 1 && h > 1)
        problems.push(`${name(a)} overlaps ${name(b)} by ${px(w)}x${px(h)} px`);
    }
  }
  const verdict = document.createElement("pre");
  verdict.id = "layout-verdict";
  verdict.textContent = JSON.stringify({width: window.innerWidth, view, boxes: boxes.length, problems});
  document.body.appendChild(verdict);
});
</script>"""


def layout_problems(page: Path, width: int, scratch: Path) -> dict:
    """Chromium's verdict on `page` laid out in a window `width` px wide: {width, view, boxes,
    problems} (each problem one line)."""
    measured = scratch / f"measured-{width}.html"
    measured.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    result = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={scratch / f'profile-{width}'}",
            f"--window-size={width},2000",
            "--virtual-time-budget=5000",
            "--dump-dom",
            measured.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r'<pre id="layout-verdict">(.*?)</pre>', result.stdout, re.S)
    assert found, f"no verdict from chromium (exit {result.returncode}): {result.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


@pytest.fixture(scope="module")
def long_paths_output(built_output, tmp_path_factory):
    """A copy of the built output whose index names its embedding model by a long cache path,
    and whose report shows an evaluation (the widest table, seven columns of numbers)."""
    from schemas.evaluation import evaluation_json
    from trainer.evaluate import evaluate

    root, _, _ = built_output
    tmp_path = tmp_path_factory.mktemp("long-paths")
    output = tmp_path / "out"
    shutil.copytree(root / "out", output)
    manifest = json.loads(current_manifest(output / "index").read_text())
    manifest["embedding_model"]["name"] = LONG_MODEL
    rewrite_manifest(output / "index", json.dumps(manifest))
    shards = read_shards_manifest(str(output / "shards"))
    checkpoint = write_checkpoint(
        tmp_path / "retro.pt",
        step=7,
        retrieval=True,
        vocab_size=30522,
        sequence_tokens=shards.sequence_tokens,
        chunk_tokens=shards.chunk_tokens,
        dim=16,
        depth=2,
        heads=2,
        encoder_depth=1,
        cca_layers=(1,),
    )
    evaluation = evaluate(str(checkpoint), str(output / "shards"), batch_size=4, max_sequences=4)
    (tmp_path / "retro.json").write_text(evaluation_json(evaluation))
    main(["report", str(output), "--eval", str(tmp_path / "retro.json")])
    return output


@pytest.mark.e2e
@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (Debian: apt-get install chromium) to lay the page out")
@pytest.mark.parametrize("width", WIDTHS)
def test_no_box_of_the_report_overlaps_another_or_leaves_the_window(long_paths_output, tmp_path, width):
    page = long_paths_output / "report.html"
    assert LONG_MODEL in page.read_text() and 'id="evaluation"' in page.read_text()
    verdict = layout_problems(page, width, tmp_path)
    assert verdict["width"] == width and verdict["boxes"] > 40, verdict  # the window asked for, a whole page
    assert verdict["problems"] == [], f"at {width} px:\n" + "\n".join(verdict["problems"])


@pytest.mark.e2e
@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (Debian: apt-get install chromium) to lay the page out")
def test_the_measure_sees_an_overlap(tmp_path):
    """The check itself: two tables side by side, the first one wider than its column."""
    wide = "x" * 300
    (tmp_path / "page.html").write_text(
        '<!DOCTYPE html><html><body><div style="display:flex;width:400px">'
        f'<div style="width:200px"><table><tr><td>{wide}</td></tr></table></div>'
        '<div style="width:200px"><table><tr><td>b</td></tr></table></div></div></body></html>'
    )
    problems = layout_problems(tmp_path / "page.html", 600, tmp_path)["problems"]
    assert any("overlaps" in line for line in problems) and any("past the viewport" in line for line in problems)
