"""The LLMProxy role: generation as a request/reply service (:mod:`.proxy`) and how a
replica follows the policy (:mod:`.policy`)."""
