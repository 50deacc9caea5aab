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
// cudaipc.ExportPointer, readable by other clients under name, without
// copying it into the store: the daemon keeps x's descriptors (never the
// memory) and hands duplicates to readers, whose leases map the memory
// read-only. The object is sealed at once. Register does not close x:
// close it once Register returns (the daemon has its own copies).
//
// VMM memory (x.VMM()) outlives this process for readers that mapped it:
// when this connection ends the object is marked orphaned (ObjectInfo),
// stays readable while leased, and the daemon drops its descriptors when
// the last lease ends; the memory is freed when the last reader unmaps.
// A legacy region (cudaMalloc memory) opens only in this process's PID
// namespace and only while it lives: the daemon removes the object when
// this connection ends, so keep it open as long as readers need the
// memory. docs/containers.md.
func (c *Client) Register(ctx context.Context, name string, x *cudaipc.PointerExport, opts RegisterOptions) (ObjectInfo, error) {
	if err := checkName("register", name); err != nil {
		return ObjectInfo{}, err
	}
	if x == nil {
		return ObjectInfo{}, &Error{Op: "register", Name: name, Err: ErrInvalid, Message: "nil export"}
	}
	r := &storev1.RegisterRequest{Name: name, Device: x.Device.String(), Shared: opts.Shared, Tensor: opts.Tensor.proto()}
	var files []*os.File
	if x.VMM() {
		if len(x.Files) != len(x.Layout.Pieces) {
			return ObjectInfo{}, &Error{Op: "register", Name: name, Err: ErrInvalid, Message: fmt.Sprintf("%d descriptors for %d pieces (closed already?)", len(x.Files), len(x.Layout.Pieces))}
		}
		r.Size, r.Offset = uint64(x.Layout.Size), uint64(x.Layout.Offset)
		for _, p := range x.Layout.Pieces {
			r.Pieces = append(r.Pieces, uint64(p))
		}
		files = x.Files
	} else {
		b, err := x.Legacy.MarshalBinary()
		if err != nil {
			return ObjectInfo{}, &Error{Op: "register", Name: name, Err: ErrInvalid, Message: err.Error()}
		}
		r.Size, r.LegacyRegion = uint64(x.Legacy.Size), b
	}
	rep, err := c.roundTripFiles(ctx, "register", name, &storev1.Request{Body: &storev1.Request_Register{Register: r}}, files)
	if err != nil {
		return ObjectInfo{}, err
	}
	return infoFromProto(rep.resp.GetRegister().GetInfo()), nil
}

// placeExternal maps registered memory for a lease: the pieces' descriptors
// (which it closes) read-only, or a legacy region.
func (c *Client) placeExternal(op, name string, p *storev1.Placement, files []*os.File, v *view) error {
	defer closeFiles(files)
	if len(p.GetPieces()) == 0 {
		m, err := importPlacement(op, name, p, nil)
		if err != nil {
			return &Error{Op: op, Name: name, Err: ErrInvalid, cause: err, Message: "the exporter registered legacy (cudaMalloc) memory, which opens only in its own PID namespace and while it lives: have it allocate VMM memory (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or cuMemCreate with POSIX fd handles) so that it registers descriptors (" + err.Error() + ")"}
		}
		v.gpu = m
		return nil
	}
	dev, err := pieceDevice(p.GetDevice())
	if err != nil {
		return &Error{Op: op, Name: name, Err: ErrInternal, Message: fmt.Sprintf("mapping the registered memory: %v", err)}
	}
	layout := cudaipc.PieceLayout{Offset: int64(p.GetOffset()), Size: int64(p.GetSize())}
	for _, n := range p.GetPieces() {
		layout.Pieces = append(layout.Pieces, int64(n))
	}
	m, err := dev.ImportPieces(files, layout, cudaipc.ReadOnly)
	if err != nil {
		return &Error{Op: op, Name: name, Err: fmt.Errorf("mapping the registered memory: %w", err)}
	}
	v.ext = m
	return nil
}

// pieceDevice picks the GPU to map registered memory of device uuid for:
// that GPU when this process sees it, else its first GPU (peer access).
func pieceDevice(uuid string) (*cudaipc.Device, error) {
	if d, err := cudaipc.LookupDevice(uuid); err == nil {
		return d, nil
	}
	devs, err := cudaipc.Devices()
	if err != nil {
		return nil, err
	}
	if len(devs) == 0 {
		return nil, fmt.Errorf("no GPU visible in this process for %s", uuid)
	}
	return devs[0], nil
}
