"""The built-in task families; importing this package registers them (k3.env.task.register_family)."""
