"""Why a hit may be served: the whole encode proven against the entry's record. Which methods encode
(``discovery``), what reaches every text-encoder call and how calls are answered by stand-ins
(``encoder_gate``, ``stand_ins``), and each method's first uses and proofs (``first_use``).

May import ``settings``, ``store``, ``encoders``, ``rows``, ``counts``, ``keys`` and the base modules.
"""
