package client

import (
	"context"
	"fmt"
	"os"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// RegisterOptions are Register's options.
type RegisterOptions struct {
	// Shared makes the object readable by every uid the daemon admits.
	Shared bool
	// Tensor optionally says what the bytes are as a typed array.
	Tensor *TensorDesc
	// Space optionally describes the KV space the memory is a region of
	// (package kv encodes it; at most protocol.MaxSpaceSize bytes): the
	// daemon keeps it and returns it in the object's info.
	Space []byte
}

// Register makes memory this process owns, exported with
// cudaipc.ExportPointer (its region r and descriptors files), readable by
// other clients under name, without copying it into the store: the daemon
// keeps the descriptors (never the memory) and hands duplicates to
// readers, whose leases map the memory read-only. The object is sealed at
// once. Register does not close files: close them once Register returns
// (the daemon has its own copies).
//
// VMM memory (a vmm-fd region) outlives this process for readers that
// mapped it: when this connection ends the object is marked orphaned
// (ObjectInfo), stays readable while leased, and the daemon drops its
// descriptors when the last lease ends; the memory is freed when the last
// reader unmaps. A legacy region (cudaMalloc memory) opens only in this
// process's PID namespace and only while it lives: the daemon removes the
// object when this connection ends, so keep it open as long as readers
// need the memory. docs/containers.md.
func (c *Client) Register(ctx context.Context, name string, r cudaipc.Region, files []*os.File, opts RegisterOptions) (ObjectInfo, error) {
	if err := checkName("register", name); err != nil {
		return ObjectInfo{}, err
	}
	invalid := func(msg string) (ObjectInfo, error) {
		return ObjectInfo{}, &Error{Op: "register", Name: name, Err: ErrInvalid, Message: msg}
	}
	b, err := r.MarshalBinary()
	if err != nil {
		return invalid(err.Error())
	}
	want := 0
	if r.Kind == cudaipc.KindVMMFD {
		want = len(r.Pieces())
	}
	if len(files) != want {
		return invalid(fmt.Sprintf("%d descriptors for a %s region of %d allocations (closed already?)", len(files), r.Kind, len(r.Pieces())))
	}
	req := &storev1.RegisterRequest{Name: name, Size: uint64(r.Size), Device: r.Device.String(), Shared: opts.Shared,
		Tensor: opts.Tensor.proto(), Region: b, Files: uint32(len(files)), Space: opts.Space}
	// Descriptors beyond one packet's are staged first; the register takes
	// them (a failed stage leaves the rest for the register to refuse and
	// drop, so a retry starts clean).
	c.registerMu.Lock()
	defer c.registerMu.Unlock()
	for len(files) > protocol.MaxFiles {
		stage := &storev1.Request{Body: &storev1.Request_StageFiles{StageFiles: &storev1.StageFilesRequest{}}}
		if _, err := c.roundTripFiles(ctx, "register", name, stage, files[:protocol.MaxFiles]); err != nil {
			return ObjectInfo{}, err
		}
		files = files[protocol.MaxFiles:]
	}
	rep, err := c.roundTripFiles(ctx, "register", name, &storev1.Request{Body: &storev1.Request_Register{Register: req}}, files)
	if err != nil {
		return ObjectInfo{}, err
	}
	return infoFromProto(rep.resp.GetRegister().GetInfo()), nil
}

// RegisterHost makes host memory this process owns, the first size bytes
// of the memfd f (created with MFD_ALLOW_SEALING, which lets the daemon
// seal it against shrinking), readable by other clients under name,
// without copying it: the daemon keeps a duplicate of f and hands
// duplicates to readers, whose leases map it read-only. Register's
// lifetime rules for VMM memory apply: when this connection ends the
// object is orphaned, stays readable while leased and goes with its last
// lease. RegisterHost does not close f.
func (c *Client) RegisterHost(ctx context.Context, name string, f *os.File, size int64, opts RegisterOptions) (ObjectInfo, error) {
	if err := checkName("register", name); err != nil {
		return ObjectInfo{}, err
	}
	if f == nil || size <= 0 {
		return ObjectInfo{}, &Error{Op: "register", Name: name, Err: ErrInvalid, Message: fmt.Sprintf("host memory needs its memfd and a positive size, not %d", size)}
	}
	req := &storev1.RegisterRequest{Name: name, Size: uint64(size), Device: "host", Shared: opts.Shared,
		Tensor: opts.Tensor.proto(), Files: 1, Space: opts.Space}
	c.registerMu.Lock()
	defer c.registerMu.Unlock()
	rep, err := c.roundTripFiles(ctx, "register", name, &storev1.Request{Body: &storev1.Request_Register{Register: req}}, []*os.File{f})
	if err != nil {
		return ObjectInfo{}, err
	}
	return infoFromProto(rep.resp.GetRegister().GetInfo()), nil
}

// moreFiles completes the descriptors of a lease of registered memory
// whose get carried the first len(have) of n: files requests bring the
// rest. It closes every descriptor on failure.
func (c *Client) moreFiles(ctx context.Context, name string, lease uint64, have []*os.File, n int) ([]*os.File, error) {
	files := have
	for len(files) < n {
		req := &storev1.Request{Body: &storev1.Request_Files{Files: &storev1.FilesRequest{LeaseId: lease, From: uint32(len(files))}}}
		rep, err := c.roundTripFiles(ctx, "get", name, req, nil)
		if err == nil && (rep.resp.GetFiles().GetFrom() != uint32(len(files)) || len(rep.files) == 0 || len(files)+len(rep.files) > n) {
			closeFiles(rep.files)
			err = &Error{Op: "get", Name: name, Err: ErrInternal, Message: fmt.Sprintf("daemon answered descriptors from %d with %d from %d", len(files), len(rep.files), rep.resp.GetFiles().GetFrom())}
		}
		if err != nil {
			closeFiles(files)
			return nil, err
		}
		files = append(files, rep.files...)
	}
	return files, nil
}
