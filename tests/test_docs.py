"""The docs site (mkdocs.yml, docs/) builds with `mkdocs build --strict`: a broken link, a page missing from the
nav, a marker naming an unknown stage or flow, or an error in the settings generator (docs/gen_settings.py) fails
the build. Each stage and flow has its page, and the generated tables carry the importer's flags."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_every_stage_and_flow_has_a_page_with_its_generated_settings(site):
    from flows.table import FLOWS

    stages = sorted(p.stem for p in (ROOT / "stages").glob("*.py") if p.stem not in ("__init__", "common"))
    for name in stages:
        html = (site / "stages" / name / "index.html").read_text()
        assert "<!-- settings" not in html and "<!-- docstring" not in html, name  # every marker expanded
        assert "<code>output_uri</code>" in html, name
    for name in FLOWS:
        html = (site / "flows" / name / "index.html").read_text()
        assert "<code>run_name</code>" in html and "<code>iterations</code>" in html, name


def test_settings_tables_name_the_openrlhf_flag_the_importer_maps(site):
    """Spot checks against flows/openrlhf_import.py's tables (both dialects, a list rule, a launcher flag, a flag
    matched by name) and OpenRLHF's parsers (docs/openrlhf_flags.json): a key no flag sets shows none."""
    row = lambda page, key: re.search(rf"<tr>\s*<td><code>{key}</code></td>.*?</tr>", (site / page).read_text(), re.S).group(0)  # noqa: E731
    assert "--pretrain" in row("stages/ppo/index.html", "policy_uri")
    assert "--model.model_name_or_path" in row("stages/ppo/index.html", "policy_uri")
    assert "--max_new_tokens" in row("stages/ppo/index.html", "generate_max_len")
    assert "--max_len" in row("stages/reference/index.html", "max_len")  # train_dpo's --max_len sets dpo and reference
    assert "--num_gpus" in row("stages/sft/index.html", "num_gpus")
    assert "--train.micro_batch_size" in row("stages/sft/index.html", "micro_train_batch_size")
    assert "--ds.zero_stage" in row("stages/dpo/index.html", "zero_stage")
    assert "--" not in row("stages/ppo/index.html", "storage_options")
    assert "--" not in row("stages/dpo/index.html", "overlong")  # no OpenRLHF flag of that name


def test_readme_links_into_the_docs_exist():
    links = re.findall(r"\]\((docs/[^)#]+)", (ROOT / "README.md").read_text())
    assert links
    for link in links:
        assert (ROOT / link).is_file(), link
