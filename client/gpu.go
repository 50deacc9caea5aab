package client

import (
	"fmt"
	"io"
	"os"
	"strconv"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// GPU objects: the daemon describes each GPU arena by the region
// (docs/region.md) of the whole device allocation, in every placement; the
// client imports the object's part of it through cudaipc's process-wide
// cache, so the first object of an arena costs one cuIpcOpenMemHandle and
// later ones cost none, and the driver mapping goes when the last Object
// or Lease of that arena in this process closes its Mapping.

// importPlacement maps the GPU object a placement with a region describes.
func importPlacement(op, name string, p *storev1.Placement) (*cudaipc.Mapping, error) {
	bad := func(format string, args ...any) error {
		return &Error{Op: op, Name: name, Err: ErrInternal, Message: fmt.Sprintf(format, args...)}
	}
	arena, err := cudaipc.DecodeRegion(p.GetRegion())
	if err != nil {
		return nil, bad("daemon sent an invalid region: %v", err)
	}
	off, size := p.GetOffset(), p.GetSize()
	if off+size < off || off+size > uint64(arena.Size) {
		return nil, bad("placement [%d, %d) lies outside the arena's %d-byte region", off, off+size, arena.Size)
	}
	if dev := arena.Device.String(); dev != p.GetDevice() {
		return nil, bad("placement on %s comes with a region of %s", p.GetDevice(), dev)
	}
	r, err := arena.Sub(int64(off), int64(size))
	if err != nil {
		return nil, bad("%v", err)
	}
	m, err := cudaipc.Import(r)
	if err != nil {
		// Not ErrInternal: the daemon did its part; this process cannot
		// map the memory (another PID namespace, no such GPU, ...), and
		// the cudaipc error says why.
		return nil, &Error{Op: op, Name: name, Err: fmt.Errorf("mapping the GPU object: %w", err)}
	}
	return m, nil
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
	if n, err := strconv.Atoi(dev); err == nil {
		d, err := cudaipc.DeviceByOrdinal(n)
		if err != nil {
			return "", fmt.Errorf("GPU ordinal %d: %v", n, err)
		}
		return d.UUID().String(), nil
	}
	u, err := cudaipc.ParseUUID(dev)
	if err != nil {
		return "", fmt.Errorf("device %q: want host, a GPU ordinal or a GPU UUID", dev)
	}
	return u.String(), nil
}

// view is where an Object's or Lease's bytes are: a slice of a mapped host
// arena, a Mapping of a GPU object shared by legacy IPC, or a part of an
// imported GPU arena shared by descriptor. Its zero value has no memory.
type view struct {
	device string
	share  string // gpuShareHost, gpuShareIPC or gpuShareFD
	size   int64
	data   []byte                // host objects
	gpu    *cudaipc.Mapping      // GPU objects shared by legacy IPC
	fd     fdView                // GPU objects shared by descriptor (fd.a != nil)
	ext    *cudaipc.PieceMapping // registered VMM memory, mapped read-only
	open   bool
}

func (v *view) readAt(op, name string, p []byte, off int64) (int, error) {
	if !v.open {
		return 0, &Error{Op: op, Name: name, Err: ErrInvalid, Message: "the object's memory is no longer mapped"}
	}
	if v.gpu != nil {
		return v.gpu.ReadAt(p, off)
	}
	if v.ext != nil {
		return v.ext.ReadAt(p, off)
	}
	if v.fd.a != nil {
		n, err := v.fd.readAt(v.size, p, off)
		if err != nil && err != io.EOF {
			return n, &Error{Op: op, Name: name, Err: ErrInvalid, Message: err.Error(), cause: err}
		}
		return n, err
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
	if v.ext != nil {
		return v.ext.WriteAt(p, off)
	}
	if v.fd.a != nil {
		return v.fd.a.m.WriteAt(p, v.fd.off+off)
	}
	return copy(v.data[off:], p), nil
}

func (v *view) ptr() cudaipc.DevicePtr {
	switch {
	case !v.open:
		return 0
	case v.gpu != nil:
		return v.gpu.Ptr()
	case v.ext != nil:
		return v.ext.Ptr()
	case v.fd.a != nil:
		return v.fd.a.m.Ptr() + cudaipc.DevicePtr(v.fd.off)
	}
	return 0
}

// cudaDevice is the GPU the object is mapped for in this process.
func (v *view) cudaDevice() *cudaipc.Device {
	switch {
	case !v.open:
		return nil
	case v.gpu != nil:
		return v.gpu.Device()
	case v.ext != nil:
		return v.ext.Device()
	case v.fd.a != nil:
		return v.fd.a.m.Device()
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
// this process unmaps it), a reference to an imported arena dropped (the
// client's last one unmaps it). It is idempotent.
func (v *view) close() error {
	if !v.open {
		return nil
	}
	v.open = false
	v.data = nil
	if v.gpu != nil {
		return v.gpu.Close()
	}
	if m := v.ext; m != nil {
		v.ext = nil
		return m.Close()
	}
	if a := v.fd.a; a != nil {
		v.fd.a = nil
		return a.unref()
	}
	return nil
}

// placeGPU maps the GPU object of placement p into v: importing its region,
// or the arena's descriptor f (which it closes).
func (c *Client) placeGPU(op, name string, p *storev1.Placement, f *os.File, v *view) error {
	v.share = gpuShareOf(p)
	if v.share == gpuShareFD {
		a, err := c.importFD(op, name, p, f)
		if err != nil {
			return err
		}
		v.fd = fdView{a: a, off: int64(p.GetOffset())}
		c.parkFD(a)
		return nil
	}
	if f != nil {
		f.Close()
	}
	m, err := importPlacement(op, name, p)
	if err != nil {
		return err
	}
	v.gpu = m
	c.parkRegion(p)
	return nil
}

// holds reports whether a create or get reply carries what its placement
// needs: the host arena's mapping, nothing more for a region, or the
// arena's descriptor.
func (r reply) holds(p *storev1.Placement) bool {
	if p.GetExternal() {
		return r.m == nil && r.file == nil && len(r.pieces) == len(p.GetPieces())
	}
	switch gpuShareOf(p) {
	case gpuShareHost:
		return r.m != nil && r.file == nil
	case gpuShareIPC:
		return r.m == nil && r.file == nil
	}
	return r.m == nil && r.file != nil
}
