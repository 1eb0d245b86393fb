"""Policy-free device primitives below the engine and the drafters: one staged host->device
copy per step (`staging`) and the in-flight position shift of overlapped steps (`shift`)."""
