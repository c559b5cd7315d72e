from dedloc.optim.optimizer import CollaborativeOptimizer, StepOutcome

__all__ = ["CollaborativeOptimizer", "StepOutcome"]
