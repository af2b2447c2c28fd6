"""The bundle's ``pretrained/`` folder: the checkpoint in PaddleNLP's ``save_pretrained`` layout with the tokenizer,
set up so that PaddleNLP's own ``from_pretrained`` and ``generate`` answer as the bundle does.

Every training document followed the end-of-document id, and the bundle conditions every prompt on it
(:class:`~train_deploy.export.runtime.LanguageModel`). So this folder's copy of the tokenizer begins every encoding
with that id: ``bos_token`` is the end-of-document piece with ``add_bos_token: true``, and the SentencePiece model's
bos piece is that piece too (PaddleNLP's ``LlamaTokenizer`` takes its bos id from there); the model's
``bos_token_id`` is that id as well (what ``generate`` starts from without a prompt). The bundle's ``tokenizer/``
folder and the project's tokenizer are left as they are: ``TokenEncoder`` adds no special token and prepends the id.

PaddleNLP 3.0.0b4's ``generate`` without an ``attention_mask`` fails for every Llama model, whatever its config:
``GenerationMixin`` makes up a 4-D float mask ``[batch, 1, 1, length]`` of zeros, which ``LlamaForCausalLM`` cannot
use (a prompt of several tokens: "The 'shape' in ReshapeOp is invalid" in its attention; of one token: its step update
appends a column as to a 2-D mask, "The shape of input[0] and input[1] is expected to be equal"). No field of this
folder avoids it, so its README.md says to pass the tokenizer's mask or ``attention_mask=paddle.ones_like(ids)``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from train_deploy.corpus.tokenizer import SP_MODEL_FILE
from train_deploy.handoffs import TOKENIZER_FILE, TokenizerInfo, write_json

logger = logging.getLogger(__name__)

README = """# {name}: the bundle's model for PaddleNLP

```python
from paddlenlp.transformers import AutoTokenizer, LlamaForCausalLM

tokenizer = AutoTokenizer.from_pretrained("{name}")
model = LlamaForCausalLM.from_pretrained("{name}")
model.eval()
inputs = tokenizer("中国人民", return_tensors="pd")  # begins with the end-of-document id ({eos}), as in training
ids, _ = model.generate(**inputs, decode_strategy="greedy_search", max_new_tokens=32)
print(tokenizer.decode(ids[0].tolist(), skip_special_tokens=True))  # the bundle's greedy text
```

Pass the `attention_mask` the tokenizer returns (`**inputs`), or `attention_mask=paddle.ones_like(input_ids)` with
`input_ids` alone: without one, PaddleNLP 3.0.0b4's `generate` fails for Llama models ("The 'shape' in ReshapeOp is
invalid", or for a one-token prompt "The shape of input[0] and input[1] is expected to be equal").
"""


def save_pretrained_folder(checkpoint: Path, tokenizer: TokenizerInfo, target: Path) -> None:
    """The checkpoint as PaddleNLP's ``save_pretrained`` writes it (``config.json`` with portable kernels,
    ``model.safetensors`` in float32) with the tokenizer's files, encodings beginning with the end-of-document id:
    what users load with ``LlamaForCausalLM.from_pretrained`` and ``training.init_from`` starts from."""
    from train_deploy.training.evaluation import load_model

    model = load_model(checkpoint)
    model.config.bos_token_id = tokenizer.eos_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.bos_token_id = tokenizer.eos_id
    model.save_pretrained(str(target), safe_serialization=True)
    shutil.copytree(tokenizer.path, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns(TOKENIZER_FILE))
    _begin_with_end_of_document(target, tokenizer.eos_id)
    (target / "README.md").write_text(README.format(name=target.name, eos=tokenizer.eos_id), encoding="utf-8")


def _begin_with_end_of_document(folder: Path, eos_id: int) -> None:
    """Make the PaddleNLP tokenizer in ``folder`` begin every encoding with ``eos_id`` (its ``bos_token``).

    PaddleNLP's ``LlamaTokenizer`` takes its bos id from the SentencePiece model (``bos_id()``: the id of the
    model's ``bos_piece``), not from ``tokenizer_config.json``, so this copy's model names the end-of-document
    piece as its bos piece too; its pieces and normalisation rules, hence every encoding, stay as they are.
    """
    from paddlenlp.transformers import AutoTokenizer

    piece = AutoTokenizer.from_pretrained(str(folder)).convert_ids_to_tokens(eos_id)
    for name, settings in (("tokenizer_config.json", {"bos_token": piece, "add_bos_token": True}),
                           ("special_tokens_map.json", {"bos_token": piece})):
        file = folder / name
        write_json(file, {**(json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}), **settings})
    sp_file = folder / SP_MODEL_FILE
    if sp_file.is_file():
        from sentencepiece import sentencepiece_model_pb2

        model = sentencepiece_model_pb2.ModelProto()
        model.ParseFromString(sp_file.read_bytes())
        model.trainer_spec.bos_piece = piece
        sp_file.write_bytes(model.SerializeToString())
    loaded = AutoTokenizer.from_pretrained(str(folder))
    if loaded("中国")["input_ids"][:1] != [eos_id]:
        logger.warning("%s: this PaddleNLP tokenizer (%s) does not begin encodings with its bos_token; PaddleNLP "
                       "users must begin prompts with the end-of-document id %d themselves to get the bundle's "
                       "answers", folder, type(loaded).__name__, eos_id)
