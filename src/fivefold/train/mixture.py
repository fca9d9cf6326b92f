"""A weighted mixture of token streams, and how a global batch is drawn from it.

Each sequence of a global batch picks its source with probability proportional to the
source's weight, then a uniform offset in that source's stream, all from the generator that
`BatchSampler` seeds with (seed, split, step) (fivefold.train.data). The draw is therefore a
pure function of the step: a resumed run and any number of data-parallel ranks, each taking
its rows of the same global batch, see exactly the batches of one uninterrupted rank. Over
many steps each source's share of the sequences tends to its weight (a multinomial draw:
after n sequences, a share p is off by about sqrt(p(1 - p) / n)).

One stream of weight 1 draws exactly as the single-source sampler always has (offsets only,
no source choice), so `data.source` runs are unchanged bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Mixture:
    """Token streams and their sampling weights (normalized on use)."""

    streams: tuple[np.ndarray, ...]
    weights: tuple[float, ...]

    @property
    def probabilities(self) -> np.ndarray:
        weights = np.asarray(self.weights, dtype=np.float64)
        return weights / weights.sum()

    def draw(self, rng: np.random.Generator, count: int, seq_len: int
             ) -> tuple[np.ndarray, np.ndarray]:
        """(source index, start offset) of `count` sequences of `seq_len + 1` tokens."""
        if len(self.streams) == 1:
            return (np.zeros(count, dtype=np.int64),
                    rng.integers(0, len(self.streams[0]) - seq_len, size=count))
        sources = rng.choice(len(self.streams), size=count, p=self.probabilities)
        offsets = np.zeros(count, dtype=np.int64)
        for i, stream in enumerate(self.streams):
            rows = sources == i
            offsets[rows] = rng.integers(0, len(stream) - seq_len, size=int(rows.sum()))
        return sources, offsets
