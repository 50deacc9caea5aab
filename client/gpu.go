package client

import (
	"fmt"
	"io"
	"os"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// GPU objects: the daemon describes each GPU arena by the region
// (docs/region.md) of the whole device allocation, in every placement, and
// says its kind: CUDA_IPC (a cuda-ipc region) or VMM_FD (a vmm-fd region,
// with the arena's descriptor beside it in every placement). The client
// imports the object's part of the region through cudaipc's process-wide
// cache, so the first object of an arena costs one driver open (or one
// descriptor import) and later ones none, and the driver mapping goes when
// the last Object or Lease of that arena in this process closes its
// Mapping. A descriptor is closed at once: kept, it would keep the arena's
// device memory allocated after the daemon frees it.

// regionKinds are the region kinds of the GPU placement kinds.
var regionKinds = map[storev1.Placement_Kind]cudaipc.Kind{
	storev1.Placement_CUDA_IPC: cudaipc.KindCUDAIPC,
	storev1.Placement_VMM_FD:   cudaipc.KindVMMFD,
}

// importPlacement maps the GPU object of placement p: the object's part
// of the placement's region, decoded once here, with files, the
// descriptors of a vmm-fd region (an arena's one, or registered memory's,
// one per piece). It returns the mapping and the placement's whole region.
func importPlacement(op, name string, p *storev1.Placement, files []*os.File) (*cudaipc.Mapping, cudaipc.Region, error) {
	bad := func(format string, args ...any) (*cudaipc.Mapping, cudaipc.Region, error) {
		return nil, cudaipc.Region{}, &Error{Op: op, Name: name, Err: ErrInternal, Message: fmt.Sprintf(format, args...)}
	}
	whole, err := cudaipc.DecodeRegion(p.GetRegion())
	if err != nil {
		return bad("daemon sent an invalid region: %v", err)
	}
	if want, ok := regionKinds[p.GetKind()]; !ok || whole.Kind != want {
		return bad("a placement of kind %s comes with a region of kind %s", p.GetKind(), whole.Kind)
	}
	off, size := p.GetOffset(), p.GetSize()
	if off+size < off || off+size > uint64(whole.Size) {
		return bad("placement [%d, %d) lies outside the %d-byte region", off, off+size, whole.Size)
	}
	if dev := whole.Device.String(); dev != p.GetDevice() {
		return bad("placement on %s comes with a region of %s", p.GetDevice(), dev)
	}
	r, err := whole.Sub(int64(off), int64(size))
	if err != nil {
		return bad("%v", err)
	}
	if n := len(r.Pieces()); r.Kind == cudaipc.KindVMMFD && len(files) != n {
		return bad("a vmm-fd placement of %d allocations with %d descriptors", n, len(files))
	}
	m, err := importRegion(r, files, p.GetWritable())
	if err != nil {
		// Not ErrInternal: the daemon did its part; this process cannot
		// map the memory (another PID namespace, no such GPU, ...), and
		// the cudaipc error says why.
		if p.GetExternal() && r.Kind == cudaipc.KindCUDAIPC {
			return nil, cudaipc.Region{}, &Error{Op: op, Name: name, Err: ErrInvalid, cause: err, Message: "the exporter registered legacy (cudaMalloc) memory, which opens only in its own PID namespace and while it lives: have it allocate VMM memory (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or cuMemCreate with POSIX fd handles) so that it registers descriptors (" + err.Error() + ")"}
		}
		return nil, cudaipc.Region{}, &Error{Op: op, Name: name, Err: fmt.Errorf("mapping the GPU object: %w", err)}
	}
	return m, whole, nil
}

// importRegion imports r, with files for a vmm-fd region, which it maps
// read-only unless writable (a lease's placement is not): a reader's
// write through it fails instead of changing what others read.
func importRegion(r cudaipc.Region, files []*os.File, writable bool) (*cudaipc.Mapping, error) {
	if r.Kind == cudaipc.KindVMMFD {
		a := cudaipc.ReadOnly
		if writable {
			a = cudaipc.ReadWrite
		}
		return cudaipc.Import(r, cudaipc.WithFiles(files...), cudaipc.WithAccess(a))
	}
	return cudaipc.Import(r)
}

// gpuUser is an Object or Lease with a GPU mapping, which Client.Close
// closes.
type gpuUser interface{ closeGPU() }

// trackGPU records u until untrackGPU; false when the client is closed
// already (then u must close its mapping itself).
func (c *Client) trackGPU(u gpuUser) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	c.gpu[u] = struct{}{}
	return true
}

func (c *Client) untrackGPU(u gpuUser) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.gpu, u)
}

func (o *Object) closeGPU() {
	o.mu.Lock()
	defer o.mu.Unlock()
	_ = o.v.close()
}

func (l *Lease) closeGPU() {
	l.mu.Lock()
	defer l.mu.Unlock()
	_ = l.v.close()
}

// resolveDevice turns CreateOptions.Device into what the daemon takes: ""
// and "host" stay, a GPU UUID is written canonically, and an ordinal
// becomes the UUID of this process's GPU with that ordinal (ordinals depend
// on CUDA_VISIBLE_DEVICES, so they never cross a process boundary).
func resolveDevice(dev string) (string, error) {
	if dev == "" || dev == "host" {
		return dev, nil
	}
	sel, err := cudaipc.ParseDeviceSelector(dev)
	if err != nil {
		return "", fmt.Errorf("device %q: want host, a GPU ordinal or a GPU UUID", dev)
	}
	if sel.IsUUID {
		return sel.UUID.String(), nil // a GPU this process need not see
	}
	d, err := sel.Device()
	if err != nil {
		return "", fmt.Errorf("GPU ordinal %d: %v", sel.Ordinal, err)
	}
	return d.UUID().String(), nil
}

// view is where an Object's or Lease's bytes are: a slice of a mapped host
// arena, or the Mapping of GPU memory (an arena's object of either region
// kind, or registered memory). Its zero value has no memory.
type view struct {
	device string
	size   int64
	data   []byte           // host objects
	gpu    *cudaipc.Mapping // GPU objects
	host   *hostMapping     // registered host memory: the mapping data lies in (hostext.go)
	open   bool
}

func (v *view) readAt(op, name string, p []byte, off int64) (int, error) {
	if !v.open {
		return 0, &Error{Op: op, Name: name, Err: ErrInvalid, Message: "the object's memory is no longer mapped"}
	}
	if v.gpu != nil {
		return v.gpu.ReadAt(p, off)
	}
	if off < 0 {
		return 0, &Error{Op: op, Name: name, Err: ErrInvalid, Message: fmt.Sprintf("negative offset %d", off)}
	}
	if off >= v.size {
		if len(p) == 0 {
			return 0, nil
		}
		return 0, io.EOF
	}
	n := copy(p, v.data[off:])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

func (v *view) writeAt(op, name string, p []byte, off int64) (int, error) {
	if !v.open {
		return 0, &Error{Op: op, Name: name, Err: ErrInvalid, Message: "the object is sealed or aborted: it can no longer be written"}
	}
	if off < 0 || off > v.size || int64(len(p)) > v.size-off {
		return 0, &Error{Op: op, Name: name, Err: ErrInvalid, Message: fmt.Sprintf("[%d, %d) is outside the %d-byte object", off, off+int64(len(p)), v.size)}
	}
	if v.gpu != nil {
		return v.gpu.WriteAt(p, off)
	}
	return copy(v.data[off:], p), nil
}

func (v *view) ptr() cudaipc.DevicePtr {
	if m := v.mapping(); m != nil {
		return m.Ptr()
	}
	return 0
}

// cudaDevice is the GPU the object is mapped for in this process.
func (v *view) cudaDevice() *cudaipc.Device {
	if m := v.mapping(); m != nil {
		return m.Device()
	}
	return nil
}

func (v *view) mapping() *cudaipc.Mapping {
	if !v.open {
		return nil
	}
	return v.gpu
}

// close ends access; a GPU Mapping is closed (the last one of an arena in
// this process unmaps it). It is idempotent.
func (v *view) close() error {
	if !v.open {
		return nil
	}
	v.open = false
	v.data = nil
	if v.host != nil {
		v.host.release()
		v.host = nil
		return nil
	}
	if v.gpu != nil {
		return v.gpu.Close()
	}
	return nil
}

// placeGPU maps the GPU object of placement p into v and parks its arena
// (registered memory has none); files are the descriptors of a vmm-fd
// region, which it closes.
func (c *Client) placeGPU(op, name string, p *storev1.Placement, files []*os.File, v *view) error {
	defer closeFiles(files)
	m, arena, err := importPlacement(op, name, p, files)
	if err != nil {
		return err
	}
	v.gpu = m
	if !p.GetExternal() {
		c.parkRegion(p.GetArenaId(), arena, files, p.GetWritable())
	}
	return nil
}

// holds reports whether a create or get reply carries what its placement
// needs: the host arena's mapping, nothing more for a cuda-ipc region, or
// the descriptors of a vmm-fd one (an arena's one, or registered memory's
// as many as the placement says).
func (r reply) holds(p *storev1.Placement) bool {
	if p.GetExternal() {
		return r.m == nil && len(r.files) == min(int(p.GetFiles()), protocol.AttachedFiles(r.manifest != nil))
	}
	switch p.GetKind() {
	case storev1.Placement_HOST:
		return r.m != nil && len(r.files) == 0
	case storev1.Placement_CUDA_IPC:
		return r.m == nil && len(r.files) == 0
	case storev1.Placement_VMM_FD:
		return r.m == nil && len(r.files) == 1
	}
	return false
}
