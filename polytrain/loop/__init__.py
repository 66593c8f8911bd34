"""What the torch and TensorFlow own-loop APIs (`polytrain.torch`, `polytrain.tensorflow`) share, with no framework
imported: the session's lifetime (`session`), stall warnings and failure reports (`watch`), checkpoints written and
read by a hand-written loop (`checkpoints`)."""
