"""The three studies, each a package of the same shape: config.py (its settings), runner.py
(runs it and returns a typed result), figures.py (every chart and its report section), plus the
machinery only that study needs.

    strategies  study 1: transfer-learning strategies with GPU-to-CPU fallback
    ladder      study 2: the memory ladder, predicted and measured, auto-fit to a card
    split       study 3: the adaptive GPU/CPU parameter-update split
"""
