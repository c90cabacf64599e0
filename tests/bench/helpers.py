"""Running ``python -m bench <name> ...`` as a process, as its users do."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str, cwd: Path = ROOT, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=cwd, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def readme_curl_bodies(endpoint: str) -> list[dict]:
    """The JSON bodies of README's ``curl`` examples that post to ``endpoint``, in order."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    return [json.loads(re.search(r"-d '(.*?)'", b, re.S).group(1))
            for b in blocks if "curl " in b and endpoint in b]  # fmt: skip
