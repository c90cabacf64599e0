"""README's examples as the bench tests read them."""

from __future__ import annotations

import json
import re

from tests.bench.helpers import ROOT


def readme_curl_bodies(endpoint: str) -> list[dict]:
    """The JSON bodies of README's ``curl`` examples that post to ``endpoint``, in order."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    return [json.loads(re.search(r"-d '(.*?)'", b, re.S).group(1))
            for b in blocks if "curl " in b and endpoint in b]  # fmt: skip
