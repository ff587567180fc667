"""Tiny random checkpoints for the embed and classify kinds: configs of a few dimensions, tokenizers trained
on a few lines with the tokenizers library, saved the way users get them (transformers' save_pretrained,
sentence-transformers' save, or the classic sentence-transformers layout written by hand).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Batch inference turns many small requests into a few large matrix products.",
    "A sentence embedding maps text to a vector; similar texts land close together.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Le renard brun rapide saute par-dessus le chien paresseux.",
    "El zorro marrón rápido salta sobre el perro perezoso.",
    "Queues, lanes and buckets keep the padding low and the batches full.",
    "Numbers like 3.14159 and 2026 appear in text too, with punctuation!",
]
TEXTS = [
    "a fox",
    "The quick brown fox jumps over the lazy dog, again and again and again.",
    "Batch inference: many small requests.",
    "similar texts land close together",
    "Der Hund schläft.",
    " ".join(CORPUS),  # long: truncated at the limit
    "x",
    "Queues and lanes.",
]
PAIRS = [("a fox", "a dog"), ("Batch inference", "turns requests into products"), ("short", " ".join(CORPUS))]

BERT = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
ROBERTA = {"cls": "<s>", "pad": "<pad>", "sep": "</s>", "unk": "<unk>", "mask": "<mask>"}  # ids 0-4 in order


def tiny_tokenizer(style: str) -> Any:
    """A WordPiece tokenizer trained on CORPUS, with BERT's or RoBERTa's special tokens and templates,
    wrapped as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = BERT if style == "bert" else ROBERTA
    tokenizer = Tokenizer(models.WordPiece(unk_token=specials["unk"]))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=list(specials.values()))
    tokenizer.train_from_iterator(CORPUS, trainer)
    cls, sep = specials["cls"], specials["sep"]
    cls_id, sep_id = tokenizer.token_to_id(cls), tokenizer.token_to_id(sep)
    if style == "bert":
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}",
            pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, cls_id), (sep, sep_id)],
        )
        names = ["input_ids", "token_type_ids", "attention_mask"]
    else:
        tokenizer.post_processor = processors.RobertaProcessing((sep, sep_id), (cls, cls_id))
        names = ["input_ids", "attention_mask"]
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        model_input_names=names,
        unk_token=specials["unk"],
        pad_token=specials["pad"],
        cls_token=cls,
        sep_token=sep,
        mask_token=specials["mask"],
        model_max_length=40,
    )


def config(architecture: str, **extra: Any) -> Any:
    """A config of a few dimensions for ``bert``, ``xlm-roberta`` or ``mpnet`` (vocab 300, 2 layers)."""
    from transformers import BertConfig, MPNetConfig, XLMRobertaConfig

    shape = {"vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    shape |= {"intermediate_size": 64, "max_position_embeddings": 64}
    if architecture == "bert":
        return BertConfig(**shape, pad_token_id=0, **extra)
    if architecture == "xlm-roberta":
        return XLMRobertaConfig(**shape, pad_token_id=1, bos_token_id=0, eos_token_id=2, **extra)
    return MPNetConfig(**shape, pad_token_id=1, bos_token_id=0, eos_token_id=2, **extra)


def style_of(architecture: str) -> str:
    return "bert" if architecture == "bert" else "roberta"


def hf_encoder(directory: Path, architecture: str, seed: int = 0) -> Path:
    """A plain Hugging Face encoder directory (AutoModel's save_pretrained and the tokenizer)."""
    import torch
    from transformers import AutoModel

    torch.manual_seed(seed)
    model = AutoModel.from_config(config(architecture))
    _spread(model)
    model.save_pretrained(str(directory))
    tiny_tokenizer(style_of(architecture)).save_pretrained(str(directory))
    return directory


def sentence_transformer(
    directory: Path,
    architecture: str,
    pooling: str = "mean",
    normalize: bool = True,
    max_seq_length: int = 24,
) -> Path:
    """The encoder saved by sentence-transformers (its own, current layout) with a pooling and Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    plain = hf_encoder(directory.with_name(directory.name + "-hf"), architecture)
    transformer = Transformer(str(plain), max_seq_length=max_seq_length)
    modules: list[Any] = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(directory))
    return directory


def classic_sentence_transformer(
    directory: Path,
    architecture: str,
    pooling: str = "mean",
    normalize: bool = True,
    max_seq_length: int = 20,
) -> Path:
    """The classic layout older sentence-transformers saved (as all-MiniLM-L6-v2 ships): modules.json,
    sentence_bert_config.json, 1_Pooling/config.json with pooling_mode_* flags."""
    hf_encoder(directory, architecture)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    flags = {
        f"pooling_mode_{name}": False
        for name in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")
    }
    flags[
        {
            "mean": "pooling_mode_mean_tokens",
            "cls": "pooling_mode_cls_token",
            "max": "pooling_mode_max_tokens",
        }[pooling]
    ] = True
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, **flags})
    )
    return directory


def classifier(directory: Path, architecture: str, labels: int = 3, multi_label: bool = False) -> Path:
    """A sequence-classification checkpoint with named labels (single- or multi-label)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    id2label = {i: name for i, name in enumerate(["negative", "neutral", "positive", "spam"][:labels])}
    extra: dict[str, Any] = {"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}}
    if multi_label:
        extra["problem_type"] = "multi_label_classification"
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(config(architecture, **extra))
    _spread(model)
    model.save_pretrained(str(directory))
    tiny_tokenizer(style_of(architecture)).save_pretrained(str(directory))
    return directory


def _spread(model: Any) -> None:
    """Weights larger than the init's 0.02, so outputs differ clearly between texts (a test that compares
    vectors must be able to fail)."""
    import torch

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1 and "embeddings" not in name:
                parameter.normal_(0, 0.3)
