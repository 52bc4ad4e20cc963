"""DAC (Zec et al.): a simulated peer-to-peer network; each client averages with its top-k peers by
cosine similarity."""

from strategies.declaration import KEEPS_MODEL_ON_DRIFT, Declaration, Facts
from strategies.peer import DacStrategy

#: This method's one declaration: the method table finds it by this module's name.
METHOD = Declaration(
    "averaging with the top-k cosine-similar peers",
    DacStrategy,
    Facts(
        "trains its own model", "simulates the network: each client averages with its top-k peers by cosine "
        "similarity", "own model", "k models received per client",
        "every training client's model; it averages (uniformly) the `dac-neighbours` with the lowest loss on its own "
        "training data. A newcomer has no model of its own to compare by cosine similarity, so this is the similarity "
        "of Listo Zec et al.'s original DAC (a peer model's training loss on the client's data), with the paper's "
        "top-k", "`DacStrategy.newcomer_parameters`, `DacClient.newcomer_model`", "lowest-loss peers",
        KEEPS_MODEL_ON_DRIFT,
        server_state=True,
    ),
)  # fmt: skip
