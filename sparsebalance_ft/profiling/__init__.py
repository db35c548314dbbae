"""`sbft profile`: time the recipe's model as it trains and fit the cost model's tables.

An application of training (it loads and steps the model through `train/`), kept apart from
`cost/`, the pure predictor library it produces, so that imports run one way: profiling ->
train -> cost.
"""
