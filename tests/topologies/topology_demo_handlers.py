"""A handler module that lives next to its topology (demo.yaml): found through add_to_sys_path."""


async def thinker(inputs: dict, ctx) -> dict:
    return {"text": str(inputs.get("prompt", ""))}
