"""pFedHN's hypernetwork (Shamsian, Navon, Fetaya and Chechik, ICML 2021): one learned embedding per
client, mapped by an MLP to every weight of the client's model, and the server's update rule.

Section 3 and Algorithm 1 of the paper: h(v_i; phi) -> theta_i; client i trains theta_i locally to
theta~_i; the server moves phi and v_i along (grad theta_i)^T (theta_i - theta~_i), the chain rule
with the client's update standing for the gradient of its loss at theta_i. The architecture is the
paper's: an MLP of ``hidden_layers`` layers of ``hidden`` units (3 x 100) and one linear head per
weight tensor of the target model; the server's optimiser the paper's SGD (momentum 0.9, weight
decay 1e-3); the gradient norm clipped at 50, as the authors' code does.

Only the target's parameters are generated. Its buffers (batch norm's running mean and variance and
its step counter) are statistics of the data, not weights a loss gradient moves: generated and
stepped along a client's change of them (as parameters are), a linear head drove a running variance
negative and every evaluation NaN (CIFAR-10, round 3 of the published check, docs/baselines.md).
Each client is served the buffers it returned last (the initial model's before it has trained), a
client without a model of its own (a newcomer) their mean over the clients that have trained.
Core code: no Flower (strategies/pfedhn.py adapts it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from fedcond.model.aggregation import uniform_average
from fedcond.model.networks import get_weights

GRADIENT_CLIP = 50.0
#: The heads' initial weights, scaled down from PyTorch's default (and their bias the seeded model):
#: at the default scale, without that bias, training diverged on digits (loss inf in round 4).
HEAD_SCALE = 0.1
MOMENTUM, WEIGHT_DECAY = 0.9, 1e-3

Model = list[np.ndarray]


class HyperNetwork(nn.Module):
    """Client embeddings and the MLP that maps one to the parameters of a model like ``target``."""

    def __init__(self, target: nn.Module, num_clients: int, embedding_dim: int, hidden: int = 100,
                 hidden_layers: int = 3, seed: int = 0) -> None:  # fmt: skip
        super().__init__()
        torch.manual_seed(seed)
        parameters = {name for name, _ in target.named_parameters()}
        names = list(target.state_dict())
        self.template = template = get_weights(target)
        #: The indices (in ``get_weights`` order) of the target's parameters: what is generated.
        self.generated = [i for i, name in enumerate(names) if name in parameters]
        #: Where the buffers are among the model's arrays, and each client's buffers (arrays) as it last
        #: returned them.
        self.buffer_indices = [i for i in range(len(names)) if i not in self.generated]
        self.client_buffers: dict[int, Model] = {}
        self.embeddings = nn.Embedding(num_clients, embedding_dim)
        layers: list[nn.Module] = [nn.Linear(embedding_dim, hidden)]
        for _ in range(hidden_layers - 1):
            layers += [nn.ReLU(), nn.Linear(hidden, hidden)]
        self.mlp = nn.Sequential(*layers)
        self.heads = nn.ModuleList(nn.Linear(hidden, int(template[i].size)) for i in self.generated)
        with torch.no_grad():  # round 1 generates the run's seeded initial model, whatever the embedding,
            for head, i in zip(self.heads, self.generated, strict=True):  # plus a small part from it
                head.bias.copy_(torch.from_numpy(np.asarray(template[i], np.float32).ravel()))
                head.weight.mul_(HEAD_SCALE)

    def forward(self, embedding: torch.Tensor) -> list[torch.Tensor]:
        features = self.mlp(embedding)
        return [head(features).view(self.template[i].shape) for head, i in zip(self.heads, self.generated, strict=True)]

    def embedding(self, client: int | None) -> torch.Tensor:
        """Client ``client``'s embedding; None: the mean of them all (a client with none of its own)."""
        weights = self.embeddings.weight
        return weights.mean(dim=0) if client is None else weights[client]

    def weights_for(self, client: int | None) -> Model:
        """The model the hypernetwork generates for ``client``, with its last returned buffers (None:
        from the mean embedding, with the clients' mean buffers)."""
        return self.weights_from(self.embedding(client), self.buffers_of(client))

    def buffers_of(self, client: int | None) -> Model:
        """``client``'s buffers as it last returned them (the initial model's before that); None: the
        mean of every client's (integer ones, batch norm's step counter, as the initial model's)."""
        initial = [self.template[i] for i in self.buffer_indices]
        if client is not None:
            return self.client_buffers.get(client, initial)
        if not self.client_buffers:
            return initial
        mean = uniform_average(list(self.client_buffers.values()))
        return [array if np.issubdtype(array.dtype, np.floating) else self.template[i]
                for array, i in zip(mean, self.buffer_indices, strict=True)]  # fmt: skip

    def keep_buffers(self, client: int, returned: Model) -> None:
        """Serve ``client`` the buffers of the model it returned from now on."""
        self.client_buffers[client] = self.returned_buffers(returned)

    def returned_buffers(self, returned: Model) -> Model:
        return [np.array(returned[i], copy=True) for i in self.buffer_indices]

    @torch.no_grad()
    def weights_from(self, embedding: torch.Tensor, buffers: Model) -> Model:
        """The model the hypernetwork generates from ``embedding``, with ``buffers``."""
        model: Model = [np.empty(0)] * len(self.template)
        for i, tensor in zip(self.generated, self(embedding), strict=True):
            model[i] = tensor.numpy().astype(self.template[i].dtype)
        for i, array in zip(self.buffer_indices, buffers, strict=True):
            model[i] = np.array(array, copy=True)
        return model

    def update_surrogate(self, embedding: torch.Tensor, sent: Model, returned: Model) -> torch.Tensor:
        """(h(embedding) . (theta_sent - theta_returned)): its gradient is the chain rule of Algorithm 1,
        line 9, with the client's update standing for its loss gradient at the model it was sent."""
        deltas = [torch.from_numpy(np.asarray(sent[i], np.float32) - np.asarray(returned[i], np.float32))
                  for i in self.generated]  # fmt: skip
        return sum((tensor * delta).sum() for tensor, delta in zip(self(embedding), deltas, strict=True))  # type: ignore[return-value]


class HyperNetworkTrainer:
    """The server's step for one client's update (Algorithm 1, lines 8-9)."""

    def __init__(self, net: HyperNetwork, learning_rate: float) -> None:
        self.net = net
        self.optimizer = torch.optim.SGD(net.parameters(), lr=learning_rate, momentum=MOMENTUM,
                                         weight_decay=WEIGHT_DECAY)  # fmt: skip

    def step(self, client: int, sent: Model, returned: Model) -> None:
        """Move phi and v_client along (grad theta)^T (theta_sent - theta_returned)."""
        self.step_together([(client, sent, returned)])

    def step_together(self, updates: Sequence[tuple[int, Model, Model]]) -> None:
        """One step along the mean over ``updates`` (client, model sent, model returned) of each
        client's (grad theta)^T (theta_sent - theta_returned): phi moves along the clients' mean, each
        embedding along its own client's share. Algorithm 1 with a batch of clients per step: every
        update is measured from the hypernetwork it was generated by, as one step per client in turn
        is not after its first."""
        self.optimizer.zero_grad()
        surrogate = sum(self.net.update_surrogate(self.net.embedding(client), sent, returned)
                        for client, sent, returned in updates)  # fmt: skip
        (surrogate / len(updates)).backward()  # type: ignore[operator, union-attr]
        nn.utils.clip_grad_norm_(self.net.parameters(), GRADIENT_CLIP)
        self.optimizer.step()
        for client, _, returned in updates:
            self.net.keep_buffers(client, returned)

    def state(self) -> tuple[Model, Model]:
        """The hypernetwork's parameters and the optimiser's momentum, as arrays (a checkpoint)."""
        parameters, momentum = [], []
        for p in self.net.parameters():
            parameters.append(p.detach().numpy().copy())
            buffer = self.optimizer.state.get(p, {}).get("momentum_buffer")  # none before the first step
            momentum.append(np.zeros_like(parameters[-1]) if buffer is None else buffer.numpy().copy())
        return parameters, momentum

    def load_state(self, parameters: Sequence[np.ndarray], momentum: Sequence[np.ndarray]) -> None:
        with torch.no_grad():
            for p, array in zip(self.net.parameters(), parameters, strict=True):
                p.copy_(torch.from_numpy(np.asarray(array)))
        for p, array in zip(self.net.parameters(), momentum, strict=True):
            self.optimizer.state[p]["momentum_buffer"] = torch.from_numpy(np.array(array, copy=True))


class NewcomerEmbedding:
    """A novel client's embedding, learned with the hypernetwork frozen (the paper's experiment on
    generalisation to novel clients): it starts at the mean of the training clients' embeddings and
    each of the client's updates moves only it, by SGD (momentum 0.9, the hypernetwork's clipping, no
    weight decay, a learning rate of its own); phi never sees a newcomer's update."""

    def __init__(self, net: HyperNetwork, learning_rate: float) -> None:
        self.net = net
        self.embedding = nn.Parameter(net.embedding(None).detach().clone())
        self.optimizer = torch.optim.SGD([self.embedding], lr=learning_rate, momentum=MOMENTUM)
        #: The training clients' mean buffers, then the newcomer's own as it last returned them.
        self.buffers = net.buffers_of(None)

    def weights(self) -> Model:
        return self.net.weights_from(self.embedding.detach(), self.buffers)

    def step(self, sent: Model, returned: Model) -> None:
        """Move the embedding alone along (grad_v theta)^T (theta_sent - theta_returned)."""
        (gradient,) = torch.autograd.grad(self.net.update_surrogate(self.embedding, sent, returned), [self.embedding])
        self.embedding.grad = gradient * min(1.0, GRADIENT_CLIP / max(float(gradient.norm()), 1e-12))
        self.optimizer.step()
        self.buffers = self.net.returned_buffers(returned)
