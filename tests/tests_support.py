"""Constants shared by tests (importable: tests/ is on sys.path via conftest rootdir)."""

PROMPTS: list[list[int]] = [
    [1, 17, 300, 45],
    [1, 99, 5, 1200, 77, 640, 8, 13, 21, 34, 55],
    [1, 600],
    [1, 7, 7, 7, 250, 1800, 42, 3, 999, 1500, 64, 128, 256, 512, 1024, 2000, 11, 12, 13, 14, 15, 16],
]
