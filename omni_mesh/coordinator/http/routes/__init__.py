"""The coordinator's routes, one router per module; coordinator.app assembles them."""
