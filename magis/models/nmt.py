"""Echo's LSTM translation model (NMT) as a plain module: the RNN workload of Echo (ISCA'20).

Echo §II-B (Fig. 2) describes the model, after Bahdanau et al. [4] and GNMT [7], as it
trains in Sockeye [22]: an **encoder** (source embedding, then a stacked LSTM whose hidden
states at every time step form the source hidden state ``[B x T x H]``), a **decoder**
(target embedding, then a stacked LSTM started from the encoder's final states, one
query ``h_t`` per target word) and **attention** (a score of each query against every
encoder state, softmax weights, the weighted-average context ``c_t``, and the attention
hidden state ``a_t`` from the concatenation ``[c_t; h_t]``), then the output layer and the
training loss. Echo §VI-A trains it on IWSLT'15 English-Vietnamese with the
hyperparameters of Zhu et al. [12] (TBD), batch 128 (§VI-B, Fig. 15).

The paper gives no layer sizes, so preset ``paper`` takes the standard IWSLT'15 En-Vi
configuration of the Luong et al. seq2seq tutorial that Echo cites ([48], [53]) and whose
data its benchmark uses: 2 layers of 512 LSTM units, 512-wide embeddings, dropout 0.2,
sentences of at most 50 tokens, vocabularies of 17,191 English and 7,709 Vietnamese
words, batch 128. The encoder is laid out as Sockeye's: its first layer bidirectional
(``H/2`` units each way, outputs concatenated to ``H``), the remaining ``layers - 1``
unidirectional. Every sentence is ``seq`` tokens long (the longest bucket, no padding).

The attention is Bahdanau et al.'s [4] "MLP" score, Sockeye's default attention type
(``--rnn-attention-type mlp``): ``e_ts = v^T tanh(W_q h_t + W_k h_s)``. Computed for
every target step against every source state it makes ``(B, T, S, H)`` feature maps, the
``T^2 x N`` attention feature maps Echo §IV-A (Fig. 8) recomputes: the encoder's projected
states ``W_k h_s`` (``T x N``) are read by every target step. (A Luong "general" score
``h_t^T W_a h_s`` makes no such maps; with it this workload's eager peak at paper size was
1,178 MiB instead of 2,465.)

What follows Luong et al. (EMNLP 2015, §3) where the paper leaves a choice open:

- the attention hidden state is ``a_t = tanh(W_c [c_t; h_t])`` (§3.1, Eq. 5); no biases in
  the attention;
- the decoder runs over the whole teacher-forced target sequence first and attention is
  then computed for every time step at once (batched matrix products), so the captured
  graph has no Python loop over time outside the LSTMs. Echo's Fig. 2 feeds ``a_t`` into
  the next decoder step ("input feeding", Luong §3.3); that makes attention part of the
  recurrence and is left out here: the attention tensors and their shapes are the same;
- the decoder's initial state per layer is the encoder's final state of that layer (the
  two directions of the first layer concatenated), passed as it is ("the encoder passes
  its internal hidden states to the decoder", §II-B);
- dropout (``p = dropout``) on both embeddings, between the encoder's bidirectional layer
  and the rest, between stacked layers inside each ``nn.LSTM`` (``dropout=``) and on the
  attention hidden state before the output projection.

``forward(source_ids, target_ids)`` takes ``(B, seq)`` source and ``(B, seq + 1)`` target
token ids: the decoder reads ``target_ids[:, :-1]`` and the loss is the cross-entropy of
its predictions against the next tokens ``target_ids[:, 1:]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from magis.models.workloads import Built, Workload


class NMT(nn.Module):
    """LSTM encoder-decoder with MLP attention (Echo §II-B, Fig. 2); returns the training loss."""

    def __init__(
        self,
        source_vocab: int,
        target_vocab: int,
        embed: int = 512,
        hidden: int = 512,
        layers: int = 2,
        dropout: float = 0.2,
    ) -> None:
        super().__init__()
        if hidden % 2 or layers < 1:
            raise ValueError(f"hidden must be even and layers positive, got hidden={hidden}, layers={layers}")
        self.source_embed = nn.Embedding(source_vocab, embed)
        self.target_embed = nn.Embedding(target_vocab, embed)
        self.dropout = nn.Dropout(dropout)
        # Sockeye's encoder: a bidirectional first layer of H/2 units each way, so that its
        # concatenated output (and the decoder's first initial state) is H wide.
        self.encoder_first = nn.LSTM(embed, hidden // 2, bidirectional=True)
        # An nn.LSTM drops out between its own layers only (one layer: none, and a warning at dropout > 0);
        # the dropout between the bidirectional layer and the rest is encode()'s.
        rest_dropout = dropout if layers > 2 else 0.0
        self.encoder_rest = nn.LSTM(hidden, hidden, layers - 1, dropout=rest_dropout) if layers > 1 else None
        self.decoder = nn.LSTM(embed, hidden, num_layers=layers, dropout=dropout)
        # e_ts = v^T tanh(W_q h_t + W_k h_s): Bahdanau's MLP score, Sockeye's default
        self.keys = nn.Linear(hidden, hidden, bias=False)  # W_k
        self.query = nn.Linear(hidden, hidden, bias=False)  # W_q
        self.energy = nn.Linear(hidden, 1, bias=False)  # v
        self.combine = nn.Linear(2 * hidden, hidden, bias=False)  # W_c of a_t = tanh(W_c [c_t; h_t])
        self.output = nn.Linear(hidden, target_vocab)

    def encode(self, source_ids: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The source hidden states ``(S, B, H)`` and the final ``(h, c)`` per layer, ``(layers, B, H)`` each."""
        x = self.dropout(self.source_embed(source_ids.t()))  # time-major, as the LSTMs and Sockeye run
        x, (h, c) = self.encoder_first(x)
        # The two directions' final states of the first layer, side by side: (1, B, H).
        finals_h, finals_c = [torch.cat([h[0], h[1]], -1).unsqueeze(0)], [torch.cat([c[0], c[1]], -1).unsqueeze(0)]
        if self.encoder_rest is not None:
            x, (h, c) = self.encoder_rest(self.dropout(x))
            finals_h.append(h)
            finals_c.append(c)
        return x, (torch.cat(finals_h, 0), torch.cat(finals_c, 0))

    def forward(self, source_ids: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        memory, state = self.encode(source_ids)
        queries, _ = self.decoder(self.dropout(self.target_embed(target_ids[:, :-1].t())), state)
        memory, queries = memory.transpose(0, 1), queries.transpose(0, 1)  # (B, S, H), (B, T, H)
        # Attention for every target step at once: scores (B, T, S), weights, contexts (B, T, H).
        # Every query against every source state: features (B, T, S, H), scores (B, T, S).
        features = torch.tanh(self.query(queries).unsqueeze(2) + self.keys(memory).unsqueeze(1))
        weights = torch.softmax(self.energy(features).squeeze(-1), dim=-1)
        context = torch.bmm(weights, memory)
        attentional = torch.tanh(self.combine(torch.cat([context, queries], -1)))
        logits = self.output(self.dropout(attentional))
        return F.cross_entropy(logits.flatten(0, 1), target_ids[:, 1:].flatten())


def _build_nmt(sizes: dict, batch: int) -> Built:
    model = NMT(*(sizes[k] for k in ("source_vocab", "target_vocab", "embed", "hidden", "layers", "dropout")))
    source = torch.randint(0, sizes["source_vocab"], (batch, sizes["seq"]), dtype=torch.int64)
    target = torch.randint(0, sizes["target_vocab"], (batch, sizes["seq"] + 1), dtype=torch.int64)
    return Built(model, (source, target))


# IWSLT'15 En-Vi in the seq2seq tutorial Echo cites ([53]): 2 x 512 LSTM, dropout 0.2,
# vocabularies 17,191 (en) and 7,709 (vi), sentences of at most 50 tokens, batch 128.
_IWSLT15 = dict(source_vocab=17191, target_vocab=7709, embed=512, hidden=512, layers=2, dropout=0.2)

NMT_WORKLOADS: tuple[Workload, ...] = (
    Workload(
        "nmt",
        "LSTM encoder-decoder translation with MLP attention (Echo ISCA'20 §II-B), magis.models.nmt.NMT",
        {
            "tiny": dict(source_vocab=64, target_vocab=48, embed=16, hidden=16, layers=2, dropout=0.2, batch=2, seq=6),
            "small": dict(_IWSLT15, batch=48, seq=50),  # eager CPU step: 0.70 GiB live, 3.7 s (one thread)
            "paper": dict(_IWSLT15, batch=128, seq=50),
        },
        _build_nmt,
    ),
)
