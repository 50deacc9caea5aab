package client

import (
	"context"
	"fmt"
	"os"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// RegisterOptions are Register's options.
type RegisterOptions struct {
	// Shared makes the object readable by every uid the daemon admits.
	Shared bool
	// Tensor optionally says what the bytes are as a typed array.
	Tensor *TensorDesc
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
		Tensor: opts.Tensor.proto(), Region: b, Files: uint32(len(files))}
	rep, err := c.roundTripFiles(ctx, "register", name, &storev1.Request{Body: &storev1.Request_Register{Register: req}}, files)
	if err != nil {
		return ObjectInfo{}, err
	}
	return infoFromProto(rep.resp.GetRegister().GetInfo()), nil
}
