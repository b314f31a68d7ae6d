"""The engine side: one thread owns the model and every torch call; asyncio only submits and streams."""
