"""The model zoo: tiny random-init models of widely used families, each with a batch maker.

Every builder returns a fresh model in training mode whose ``model(**batch)`` returns an object with a
``.loss`` (HF ``ModelOutput`` for transformers models, ``ZooOutput`` for the torch.nn ones). Configs
are small (2 layers, hidden 32, sequences of 12, batch 2) and dropout is 0, so eager and compiled runs
compare value by value. Nothing is downloaded: models are built from config objects.
"""
from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS, FFN, SEQ, BATCH = 64, 32, 2, 4, 64, 12, 2


@dataclasses.dataclass
class ZooOutput:
    """The torch.nn models' output: a plain dataclass, as user code often returns."""

    loss: torch.Tensor
    logits: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    family: str  # for the README's list of tested families
    build: object  # () -> nn.Module
    batch: object  # (torch.Generator) -> dict of keyword arguments (same shapes on every call)


# ---------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------
def lm_batch(g, vocab=VOCAB, low=0):
    ids = torch.randint(low, vocab, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def padded_cls_batch(g, pad_id, num_labels=3, low=0):
    """Sequence classification with a padding mask: the second row's last 5 tokens are padding."""
    ids = torch.randint(max(low, pad_id + 1), VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 5:] = 0
    ids[mask == 0] = pad_id
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, num_labels, (BATCH,), generator=g)}


def seq2seq_batch(g):
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, SEQ - 3:] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(2, VOCAB, (BATCH, SEQ // 2), generator=g)}


def image_batch(g, size=16, num_labels=3):
    return {"pixel_values": torch.randn(BATCH, 3, size, size, generator=g),
            "labels": torch.randint(0, num_labels, (BATCH,), generator=g)}


# ---------------------------------------------------------------------------
# transformers models (built from configs; no downloads)
# ---------------------------------------------------------------------------
def _decoder(name, **extra):
    def build():
        import transformers

        cfg = getattr(transformers, name + "Config")(**extra)
        return getattr(transformers, name + "ForCausalLM")(cfg)

    return build


_LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, max_position_embeddings=64, attention_dropout=0.0)


_llama = _decoder("Llama", num_key_value_heads=2, tie_word_embeddings=False, **_LLAMA_LIKE)


def mixtral():
    """Mixtral with the per-expert loop (transformers' "eager" experts): routing through ``nonzero``,
    ``torch.where(mask)``, token gathers and ``index_add_``, whose sizes change with every batch."""
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
                                     num_attention_heads=HEADS, num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    model = transformers.MixtralForCausalLM(cfg)
    model.config._experts_implementation = "eager"
    return model


def deepseek_v3():
    """DeepSeek-V3: multi-head latent attention (low-rank q/kv), a dense first layer, then sigmoid routing over
    expert groups (topk of group scores, ``scatter_``), a shared expert and transformers' default grouped experts
    (``torch._grouped_mm`` over tokens sorted by expert, ``histc`` counts)."""
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8, max_position_embeddings=64)
    return transformers.DeepseekV3ForCausalLM(cfg)


def qwen2_moe():
    """Qwen2-MoE: softmax top-2 routing over 4 experts (grouped experts) plus a sigmoid-gated shared expert."""
    import transformers

    cfg = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.Qwen2MoeForCausalLM(cfg)


def modernbert_mlm():
    """ModernBERT masked LM with ``sparse_prediction``: the head runs only on the masked positions
    (``hidden[labels != -100]``, a data-dependent size), alternating global and sliding-window attention."""
    import transformers

    cfg = transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=HEADS,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        sparse_prediction=True, local_attention=4, layer_types=["full_attention", "sliding_attention"])
    return transformers.ModernBertForMaskedLM(cfg)


def mlm_batch(g):
    """Masked-LM data with padding: about 30% of the real tokens carry labels (-100 elsewhere)."""
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 4:] = 0
    ids[mask == 0] = 0
    labels = torch.full_like(ids, -100)
    pick = (torch.rand(BATCH, SEQ, generator=g) < 0.3) & (mask == 1)
    pick[0, 0] = True  # at least one label per batch
    labels[pick] = ids[pick]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def gpt2():
    import transformers

    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def bloom():
    import transformers

    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                   hidden_dropout=0.0, attention_dropout=0.0)
    return transformers.BloomForCausalLM(cfg)


def falcon():
    import transformers

    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                    hidden_dropout=0.0, attention_dropout=0.0)
    return transformers.FalconForCausalLM(cfg)


def padded_lm_batch(g):
    """A decoder batch with left padding (the first 3 tokens of row 1), as batched fine-tuning data has."""
    batch = lm_batch(g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :3] = 0
    batch["labels"][mask == 0] = -100
    return {**batch, "attention_mask": mask}


def bert_cls():
    import transformers

    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=64,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3, pad_token_id=0)
    return transformers.BertForSequenceClassification(cfg)


def roberta_cls():
    import transformers

    cfg = transformers.RobertaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=64,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
                                     pad_token_id=1, bos_token_id=0, eos_token_id=2)
    return transformers.RobertaForSequenceClassification(cfg)


def t5():
    import transformers

    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=LAYERS,
                                num_decoder_layers=LAYERS, num_heads=HEADS, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(cfg)


def vit():
    import transformers

    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=HIDDEN,
                                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    return transformers.ViTForImageClassification(cfg)


def wav2vec2_ctc():
    import transformers

    cfg = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, ctc_loss_reduction="mean",
        pad_token_id=0)
    return transformers.Wav2Vec2ForCTC(cfg)


def audio_ctc_batch(g):
    """Raw audio (400 samples: 39 frames) and CTC labels of different lengths (-100 pads the second)."""
    labels = torch.randint(1, 12, (BATCH, 5), generator=g)
    labels[1, 3:] = -100
    return {"input_values": torch.randn(BATCH, 400, generator=g), "labels": labels}


# ---------------------------------------------------------------------------
# torch.nn models
# ---------------------------------------------------------------------------
class TransformerEncoderLM(nn.Module):
    """``nn.TransformerEncoder`` (post-norm layers, GELU) with a causal mask and learned positions."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout=0.0, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        t = input_ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=input_ids.device)
        h = self.encoder(self.tok(input_ids) + self.pos[:t], mask=mask, is_causal=True)
        logits = self.head(h)
        return ZooOutput(F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)), logits)


class RNNLM(nn.Module):
    """A two-layer LSTM or GRU language model (batch_first)."""

    def __init__(self, cell):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.rnn = cell(HIDDEN, HIDDEN, num_layers=LAYERS, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        h, _ = self.rnn(self.tok(input_ids))
        logits = self.head(h)
        return ZooOutput(F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)), logits)


class ResBlock(nn.Module):
    def __init__(self, c, norm):
        super().__init__()
        self.conv1, self.n1 = nn.Conv2d(c, c, 3, padding=1, bias=False), norm(c)
        self.conv2, self.n2 = nn.Conv2d(c, c, 3, padding=1, bias=False), norm(c)

    def forward(self, x):
        return F.relu(x + self.n2(self.conv2(F.relu(self.n1(self.conv1(x))))))


class ResNet(nn.Module):
    """A ResNet-style CNN: a strided stem, one BatchNorm block (running stats) and one GroupNorm block."""

    def __init__(self, c=8, num_labels=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.bn_block = ResBlock(c, nn.BatchNorm2d)
        self.gn_block = ResBlock(c, lambda ch: nn.GroupNorm(2, ch))
        self.head = nn.Linear(c, num_labels)

    def forward(self, pixel_values, labels):
        h = self.gn_block(self.bn_block(self.stem(pixel_values)))
        logits = self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))
        return ZooOutput(F.cross_entropy(logits, labels), logits)


CASES = {c.name: c for c in [
    # decoder LMs
    Case("gpt2", "GPT-2 (learned positions, tied embeddings)", gpt2, lm_batch),
    Case("llama", "Llama (rotary, grouped-query attention, untied embeddings)", _llama, lm_batch),
    Case("mistral", "Mistral (sliding-window attention, grouped-query attention)",
         _decoder("Mistral", num_key_value_heads=2, sliding_window=4, tie_word_embeddings=False, **_LLAMA_LIKE), lm_batch),
    Case("qwen2", "Qwen2 (rotary, QKV biases, tied embeddings)",
         _decoder("Qwen2", num_key_value_heads=2, tie_word_embeddings=True, **_LLAMA_LIKE), lm_batch),
    Case("bloom", "BLOOM (ALiBi positions, tied embeddings)", bloom, lm_batch),
    Case("mixtral", "Mixtral sparse mixture-of-experts (top-2 routing, per-expert loop: data-dependent sizes)",
         mixtral, lm_batch),
    Case("deepseek_v3", "DeepSeek-V3 (latent attention, grouped sigmoid routing, shared expert, grouped_mm experts)",
         deepseek_v3, lm_batch),
    Case("qwen2_moe", "Qwen2-MoE (top-2 routing, grouped experts, gated shared expert)", qwen2_moe, lm_batch),
    Case("falcon", "Falcon (multi-query attention, rotary, parallel attention/MLP, weight used as W.T)", falcon, lm_batch),
    Case("llama_padded", "Llama with a left-padding attention mask", _llama, padded_lm_batch),
    # encoders, encoder-decoder, vision
    Case("bert_cls", "BERT sequence classification with a padding mask", bert_cls, lambda g: padded_cls_batch(g, 0)),
    Case("roberta_cls", "RoBERTa sequence classification with a padding mask", roberta_cls,
         lambda g: padded_cls_batch(g, 1, low=3)),
    Case("modernbert_mlm", "ModernBERT masked LM, sparse prediction head (boolean-mask selection of labelled tokens)",
         modernbert_mlm, mlm_batch),
    Case("t5", "T5 encoder-decoder with labels (relative position bias)", t5, seq2seq_batch),
    Case("vit", "ViT image classification", vit, image_batch),
    Case("wav2vec2_ctc", "wav2vec2 speech recognition with a CTC head (conv feature encoder, weight norm, ctc_loss)",
         wav2vec2_ctc, audio_ctc_batch),
    # torch.nn
    Case("transformer_encoder", "torch.nn.TransformerEncoder LM (causal mask)", TransformerEncoderLM, lm_batch),
    Case("lstm", "LSTM language model", lambda: RNNLM(nn.LSTM), lm_batch),
    Case("gru", "GRU language model", lambda: RNNLM(nn.GRU), lm_batch),
    Case("resnet", "ResNet-style CNN with BatchNorm (running stats) and GroupNorm", ResNet,
         lambda g: image_batch(g, size=8)),
]}


def build(name, seed=0):
    """A fresh model of the case, in training mode, from a fixed seed."""
    torch.manual_seed(seed)
    return CASES[name].build().train()


def batches(name, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [CASES[name].batch(g) for _ in range(n)]


def tensor_leaves(out, path="out"):
    """(path, value) for every leaf of a model output: ModelOutput/dicts, dataclasses, tuples, lists, and types
    registered with torch.utils._pytree (e.g. transformers' DynamicCache once its registration is installed)."""
    import torch.utils._pytree as pytree

    if isinstance(out, dict):
        return [leaf for k, v in out.items() for leaf in tensor_leaves(v, f"{path}[{k!r}]")]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [leaf for f in dataclasses.fields(out) for leaf in tensor_leaves(getattr(out, f.name), f"{path}.{f.name}")]
    if isinstance(out, (tuple, list)):
        return [leaf for i, v in enumerate(out) for leaf in tensor_leaves(v, f"{path}[{i}]")]
    if not isinstance(out, torch.Tensor) and not pytree.tree_is_leaf(out):
        children, _ = pytree.tree_flatten(out, is_leaf=lambda y: y is not out)
        return [leaf for i, v in enumerate(children) for leaf in tensor_leaves(v, f"{path}<{i}>")]
    return [(path, out)]


def train_step(model, opt, batch):
    """The whole training step every zoo model is checked with (eager and compiled run this same function)."""
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
