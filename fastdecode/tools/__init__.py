"""Tools around the fleet: checkpoints, GGUF import, stub generation, the process supervisor."""
