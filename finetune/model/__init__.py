"""The model: building it for training, its adapters, loading what training wrote, and vision-language
models (their parts, and the table of vision families that the planner and the data path ask).
"""
