// Package cudaipc shares GPU memory between processes of one machine
// without copying it, over the CUDA driver's IPC API (libcuda.so.1, loaded
// at run time: a machine without a driver builds, tests, and gets
// ErrNoDriver).
//
// # Sharing memory
//
// The exporter describes a byte range of its device memory as a Region and
// hands it to another process by any means (a pipe, a socket, a file):
//
//	buf, _ := dev.Alloc(64 << 20)
//	r, _ := buf.Export(4096, 1<<20) // 1 MiB starting 4 KiB in
//	msg, _ := json.Marshal(r)       // or r.MarshalBinary(): 164 bytes
//
// The importer maps it and uses the pointer on its GPU:
//
//	var r cudaipc.Region
//	_ = json.Unmarshal(msg, &r)     // validates every field
//	m, _ := cudaipc.Import(r)
//	defer m.Close()
//	_ = m.Device().Copy(dst, m.Ptr(), m.Size())
//
// A Region records the allocation's handle, the offset and size inside it,
// the GPU's UUID, the exporter's pid, PID namespace and boot id, and the
// allocation's buffer id. docs/region.md specifies both encodings for
// programs in other languages; Export accepts memory allocated by PyTorch,
// CuPy or C in this process as well as a Buffer.
//
// Legacy IPC handles work only within one PID namespace. Across containers,
// allocate with Device.AllocShareable (VMM memory) and export a KindVMMFD
// region with ShareableBuffer.Export: it names the allocation by a random
// AllocationID, and its POSIX file descriptor (ShareableBuffer.ExportFD)
// travels beside it over a Unix socket. The importer calls
// Import(r, WithFile(f)) and gets the same *Mapping, through the same
// cache. Device.ImportFD maps a bare descriptor into a Mapping of its
// own, outside the cache.
//
// # Lifetimes
//
// The exporter must not free the memory before every importer has closed
// its mappings. CUDA does not say what an importer sees after the exporter
// frees: the physical memory may stay mapped or be handed to a new
// allocation. If the exporter exits (or crashes), mappings that are already
// open stay valid until closed, but no new import of its handles succeeds
// (ErrInvalidResourceHandle). Coordinating who frees when is the object
// store's job; within one process, Buffer.Free returns ErrInUse while
// Mappings of that Buffer imported in the same process are open.
//
// Mapping.Close releases one import. Closing twice is not an error. A
// Mapping that becomes unreachable without Close is closed by a cleanup and
// the leak is logged with log/slog; LiveObjects counts open Mappings, so
// tests can fail on leaks. Keep the Mapping reachable while work on the GPU
// uses its pointer.
//
// # The import cache
//
// Opening a handle costs 40 µs to 13 ms, importing a descriptor
// milliseconds. Import goes through one process-wide cache for both kinds,
// keyed by the handle's bytes and the exporter's PID namespace (KindCUDAIPC)
// or the allocation id (KindVMMFD), and the device mapped through: the
// first import of an allocation opens it, later imports of the same
// allocation at any offset share that mapping and count references, and the
// last Close unmaps it. Concurrent first imports open once; a failed open is
// returned to those that waited on it and not remembered. ImportCacheStats
// reports what the cache did.
//
// Handle bytes can repeat: an allocation freed and another made at the same
// address often exports the same bytes. The buffer id tells them apart, so
// an entry whose buffer id differs from the region's is never reused; if the
// driver hands back the old mapping for the new allocation (it counts opens
// by handle), Import returns ErrStaleMapping instead of the old memory.
// Close the old Mappings and import again.
//
// Import also asks the driver for the size of what it mapped
// (cuMemGetAddressRange) and refuses a region whose AllocSize is larger
// with a *RegionError naming alloc_size, before any copy could read past
// the allocation.
//
// # Devices
//
// Devices are matched by UUID, never by ordinal: CUDA_VISIBLE_DEVICES
// renumbers GPUs per process. Import maps through the visible GPU with the
// region's UUID; if the exporter's GPU is hidden, through the device named
// by WithFallbackDevice (default: the first visible one), which reaches the
// memory by peer access.
//
// # Same process, other processes, other machines
//
// Importing in the process that exported the region returns the exporter's
// own memory, without any IPC call (the driver refuses to open a handle in
// its exporter). Legacy IPC works only between processes of one boot of one
// machine, in one PID namespace: a Region from elsewhere fails with
// ErrOtherHost or ErrOtherPIDNamespace, whose messages say what to use
// instead (copying the bytes, or the VMM POSIX-fd path through the store
// daemon, which crosses containers).
//
// # Ordering across processes
//
// Copies and kernels are asynchronous. The producer creates an interprocess
// event (Device.NewIPCEvent), hands out its EventDescriptor (Event.Export),
// and calls Event.Signal on its stream after the writes; the consumer
// imports it once (ImportEvent, cached like memory) and calls
// RemoteEvent.Wait on its stream before the reads.
//
// # Security
//
// Handles, Regions and EventDescriptors are bearer capabilities: any
// process of the same machine and PID namespace that holds one can read and
// write the memory. Send them only over channels you trust, do not log them
// (their String methods print a fingerprint, not the bytes), and do not
// store them where other users can read them.
package cudaipc
