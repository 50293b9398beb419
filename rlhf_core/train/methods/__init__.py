"""Training methods: one module each (see rlhf_core.train.methods.__init__ once the protocol lands)."""
