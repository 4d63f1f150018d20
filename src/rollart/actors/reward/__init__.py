"""The RewardService role: stateless scoring as a request/reply service (:mod:`.actor`)."""
