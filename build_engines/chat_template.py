"""The model's chat template, written into the engine directory as ``chat_template.jinja``.

From the GGUF's ``tokenizer.chat_template``, or a Hugging Face checkpoint's ``chat_template.jinja``
(which transformers prefers) or ``tokenizer_config.json`` ``chat_template`` (a string, or a list of
named templates, of which ``default`` is taken). The manifest names the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from trtserver.chat_template import TEMPLATE_FILE, template_from_tokenizer_config


def checkpoint_chat_template(checkpoint: Path) -> str | None:
    jinja = checkpoint / TEMPLATE_FILE
    if jinja.is_file():
        text = jinja.read_text(encoding="utf-8")
        return text or None
    config_path = checkpoint / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text(encoding="utf-8"))
    return template_from_tokenizer_config(config) if isinstance(config, dict) else None


def write_chat_template(engine_dir: Path, template: str | None) -> str | None:
    """Write ``template`` as the engine directory's template file; return the name the manifest records."""
    if not template:
        return None
    (engine_dir / TEMPLATE_FILE).write_text(template, encoding="utf-8")
    return TEMPLATE_FILE
