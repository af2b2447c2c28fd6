"""training.init_from a PaddleNLP model folder written here with save_pretrained: its weights, its tokenizer and its
shape are what the run starts from, and what does not fit is refused naming the file and the key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.project import corpus_params, publish
from tests.helpers.training import training_params
from train_deploy.config import ConfigError
from train_deploy.corpus.config import CorpusConfig
from train_deploy.handoffs import TOKENIZER_FILE, TokenizerInfo, WorkFolder
from train_deploy.pipelines.corpus.nodes import plan_inputs, prepare_tokenizer
from train_deploy.pipelines.training.nodes import configure_training, train_model
from train_deploy.registry.champion import resolve_init_source
from train_deploy.registry.config import RegistryConfig

TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "max_position_embeddings": 64}


def save_model(folder: Path, tokenizer: TokenizerInfo, safe: bool = True, **shape) -> Path:
    """A PaddleNLP Llama saved by save_pretrained with ``tokenizer``'s files beside it. Its output layer is drawn
    wide, so its loss is far from a freshly initialised model's (about ln(vocabulary))."""
    import paddle
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(7)
    model = LlamaForCausalLM(LlamaConfig(**{"vocab_size": tokenizer.vocab_size, **TINY_SHAPE, **shape}))
    model.lm_head.weight.set_value(paddle.randn(model.lm_head.weight.shape) * 0.5)
    model.save_pretrained(str(folder), safe_serialization=safe)
    shutil.copytree(tokenizer.path, folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns(TOKENIZER_FILE))
    return folder


def warm_params(folder: Path, **blocks) -> dict:
    """The tiny run's training block starting from ``folder``."""
    return {**training_params(1, **blocks), "init_from": str(folder)}


def resolve(folder: Path, tmp_path: Path, **tokenizer):
    config = CorpusConfig.from_params(corpus_params(tokenizer=tokenizer))
    return resolve_init_source(str(folder), config, RegistryConfig(), tmp_path / "init_cache")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tiny_tokenizer) -> Path:
    return save_model(tmp_path_factory.mktemp("pretrained") / "model", tiny_tokenizer)


@pytest.mark.slow
def test_first_step_loss_is_the_pretrained_models_loss_and_a_rerun_resumes_its_own_checkpoint(tmp_path, model_folder,
                                                                                              tiny_token_files):
    import paddle
    from paddlenlp.transformers import LlamaForCausalLM

    from train_deploy.export.graph import eager_logits
    from train_deploy.training.data import TokenWindows
    from train_deploy.training.evaluation import next_token_loss

    init = resolve(model_folder, tmp_path)
    params = warm_params(model_folder, batch={"micro_batch_size": 8}, schedule={"max_steps": 2, "stop_after": 1})
    folders = WorkFolder(path=str(tmp_path / "checkpoints")), WorkFolder(path=str(tmp_path / "logs"))
    config = configure_training(params, tiny_token_files, init)
    result = train_model(config, tiny_token_files, *folders, init_source=init)
    assert (result.step, result.init_from, result.init_from_hash) == (1, "folder", init.hash)

    # Resume beats init: the rerun continues from its own step 1, with the schedule's warm-up where it was.
    del params["schedule"]["stop_after"]
    config = configure_training(params, tiny_token_files, init)
    assert train_model(config, tiny_token_files, *folders, init_source=init).step == 2
    metrics = [json.loads(line) for line in
               (tmp_path / "logs" / result.run_name / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and metrics[1]["lr"] > metrics[0]["lr"]
    first = metrics[0]
    batch = TokenWindows(tiny_token_files.prefix("train"), 32, params.get("schedule", {}).get("seed", 1234),
                         tiny_token_files.dtype).batch(0, 8)
    model = LlamaForCausalLM.from_pretrained(str(model_folder))
    model.eval()
    logits = paddle.to_tensor(eager_logits(model, batch[:, :-1]))
    expected = float(next_token_loss(logits, paddle.to_tensor(batch[:, 1:])))
    assert first["step"] == 1 and expected > 9  # far from a fresh model's ln(2000) = 7.6
    assert first["loss"] == pytest.approx(expected, rel=1e-5)


def test_the_corpus_stage_encodes_with_the_model_folders_tokenizer(tmp_path, model_folder):
    config, plan = plan_inputs(corpus_params(tokenizer={"vocab_size": 1000}))  # would train 1000 ids
    init = resolve(model_folder, tmp_path, vocab_size=1000)
    info = publish(prepare_tokenizer(config, plan, init), tmp_path / "tokenizer", TokenizerInfo)
    assert info.source == init.tokenizer_path and info.vocab_size == 2000
    for name in ("sentencepiece.bpe.model", "tokenizer_config.json"):
        assert (Path(info.path) / name).read_bytes() == (model_folder / name).read_bytes()
    assert not list(Path(info.path).glob("*.safetensors"))  # the weights stay out of the tokenizer folder
    assert init.shape["num_attention_heads"] == 4 and init.shape["vocab_size"] == 2000


@pytest.mark.parametrize(("shape", "training", "message"), [
    ({"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3},
     {"parallel": {"mp": 2}, "launch": {"nproc_per_node": 2}},
     "config.json: training.model: num_attention_heads = 3 is not divisible by mp = 2"),
    ({"max_position_embeddings": 16}, {},
     "config.json: training.batch.seq_length: 32 exceeds the model's max_position_embeddings \\(16\\)"),
    ({"vocab_size": 1000}, {},
     "config.json: training.model.overrides.vocab_size: the model has 1000 embeddings but the tokenizer "
     "produces 2000 ids"),
], ids=["heads", "positions", "vocabulary"])
def test_a_model_folder_that_does_not_fit_is_refused_naming_the_key(tmp_path, tiny_tokenizer, tiny_token_files,
                                                                     shape, training, message):
    folder = save_model(tmp_path / "model", tiny_tokenizer, **shape)
    init = resolve(folder, tmp_path)
    with pytest.raises(ConfigError, match=message):
        configure_training(warm_params(folder, **training), tiny_token_files, init)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "logs").exists()


def test_pickled_weights_are_refused_in_one_line(tmp_path, tiny_tokenizer):
    folder = save_model(tmp_path / "model", tiny_tokenizer, safe=False)
    assert (folder / "model_state.pdparams").is_file()
    with pytest.raises(ConfigError) as refused:
        resolve(folder, tmp_path)
    assert str(refused.value) == (f"{folder / 'model_state.pdparams'}: pickled weights are not loaded (a pickle can "
                                  "run code); re-save the model with save_pretrained(folder, "
                                  "safe_serialization=True) (training.init_from)")


def test_a_changed_folder_since_the_corpus_stage_is_refused(tmp_path, model_folder, tiny_token_files):
    copy = Path(shutil.copytree(model_folder, tmp_path / "model"))
    init = resolve(copy, tmp_path)
    (copy / "generation_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="changed since the corpus stage took its tokenizer; run the corpus stage"):
        configure_training(warm_params(copy), tiny_token_files, init)


def test_sharded_safetensors_load_as_the_whole_file_does(tmp_path, model_folder):
    import paddle
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM
    from paddlenlp.transformers.llama.modeling_network import LlamaForCausalLMNet

    from train_deploy.training.pretrained import load_pretrained_weights

    sharded = tmp_path / "sharded"
    LlamaForCausalLM.from_pretrained(str(model_folder)).save_pretrained(str(sharded), safe_serialization=True,
                                                                         max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    config = LlamaConfig.from_pretrained(str(model_folder))
    whole, shards = LlamaForCausalLMNet(config), LlamaForCausalLMNet(config)
    load_pretrained_weights(whole, model_folder)
    load_pretrained_weights(shards, sharded)
    for (name, a), b in zip(whole.state_dict().items(), shards.state_dict().values(), strict=True):
        assert paddle.equal_all(a, b), name


def test_a_missing_folder_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="training.init_from is not scratch, champion nor a folder"):
        resolve(tmp_path / "nowhere", tmp_path)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/outside.safetensors", "shards/../../x.safetensors",
                                  "model.bin", 7])
def test_a_weight_index_naming_a_file_outside_the_folder_is_refused(tmp_path, name):
    from train_deploy.training.pretrained import weight_files

    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"not read")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(ConfigError, match=r"model\.safetensors\.index\.json: names .*, which is not a \.safetensors "
                                          r"file of the folder itself \(no absolute path, no '\.\.'\); refusing"):
        weight_files(folder)
