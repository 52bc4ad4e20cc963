"""Names of the values that travel between strategy and client (Flower configs, properties, metrics).

Shared by the adapters in ``clients/`` and ``strategies/``; kept here so that a move to another
Flower API changes how values travel, not what they are called.
"""

STEP = "fedcond-step"
STEP_KEYS = "secure-sum-keys"
STEP_SHARE = "secure-sum-share"
STEP_IDENTITY = "identity"
PUBLIC_KEY = "public-key"
PUBLIC_KEYS = "public-keys"
SESSION = "session"
SHARE = "share"
SERVER_ROUND = "server-round"
FINGERPRINT_MEAN = "fingerprint-mean"
FINGERPRINT_STD = "fingerprint-std"
PARTITION_ID = "partition-id"
CLUSTER = "cluster"
TRAIN_LOSS = "train-loss"
ACCURACY = "accuracy"
CHOICE = "choice"
ERROR = "fedcond-error"
