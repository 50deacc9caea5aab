package client

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sort"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// Versions published without a copy (docs/protocol.md section 6.8): the
// version's bytes are the publisher's own GPU memory, one region per CUDA
// allocation its tensors lie in, listed in a sources table that follows the
// manifest in the manifest's memfd. The publisher must not change those
// tensors while readers copy: WaitReleased (which PublishNoCopy calls
// first) withdraws its earlier no-copy versions and waits for their last
// lease. A publisher that disconnects withdraws its legacy (cudaMalloc)
// versions at once; versions of VMM memory alone stay readable while
// leased.

// NoCopyTensor is a tensor for PublishNoCopy: its spec and where its bytes
// are, in this process, on the device given to PublishNoCopy.
type NoCopyTensor struct {
	bundle.Spec
	Ptr cudaipc.DevicePtr
}

// WaitReleased withdraws the versions of name this client published
// without a copy (no new lease of them is granted; readers of the latest
// wait for the next version) and waits until no reader holds a lease of
// them, as long as ctx allows (the client's call timeout when ctx has no
// deadline). From then on the tensors they point into may change. It
// returns how many versions it withdrew; ErrTimeout's message names the
// readers and leases left, and the versions stay withdrawn.
func (c *Client) WaitReleased(ctx context.Context, name string) (int, error) {
	if err := checkName("wait_released", name); err != nil {
		return 0, err
	}
	dl, ok := ctx.Deadline()
	if !ok {
		dl = time.Now().Add(c.callTimeout)
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, dl)
		defer cancel()
	}
	// The daemon answers TIMEOUT a little before the deadline, so that its
	// answer (naming the readers) arrives rather than the context's end.
	ms := max(time.Until(dl).Milliseconds()-20, 0)
	req := &storev1.Request{Body: &storev1.Request_Withdraw{Withdraw: &storev1.WithdrawRequest{Name: name, TimeoutMs: ms}}}
	rep, err := c.roundTrip(ctx, "wait_released", name, req)
	if err != nil {
		return 0, err
	}
	return int(rep.resp.GetWithdraw().GetVersions()), nil
}

// PublishNoCopy publishes the next version of the bundle name as the
// tensors' own memory on dev, without copying it: one region per CUDA
// allocation the tensors lie in (cudaipc.ExportPointer of each: legacy
// regions for cudaMalloc memory, readers in this PID namespace while this
// process lives; vmm-fd regions with descriptors for VMM memory, such as
// PyTorch's expandable segments, in any container). It first waits, as
// WaitReleased, until no reader holds this client's earlier no-copy
// versions of name. The tensors' writes must be complete (synchronize
// their stream) before the call, and they must not change until the next
// WaitReleased returns. Tensors may not overlap. A version whose manifest
// and regions are byte for byte the client's last one under name (the same
// tensors in the same allocations) is a republish: one request, nothing
// written (docs/protocol.md 6.8). opts.Shared and
// opts.KeepLast apply; it returns the version.
func (c *Client) PublishNoCopy(ctx context.Context, name string, dev *cudaipc.Device, tensors []NoCopyTensor, metadata map[string]string, opts CreateOptions) (uint64, error) {
	invalid := func(msg string) (uint64, error) {
		return 0, &Error{Op: "publish", Name: name, Err: ErrInvalid, Message: msg}
	}
	if err := checkName("publish", name); err != nil {
		return 0, err
	}
	if dev == nil || len(tensors) == 0 {
		return invalid("PublishNoCopy needs a device and at least one tensor")
	}
	if _, err := c.WaitReleased(ctx, name); err != nil {
		return 0, err
	}
	regions, files, bases, err := exportAllocations(dev, tensors)
	if err != nil {
		return invalid(err.Error())
	}
	defer closeFiles(files)
	sizes := make([]int64, len(regions))
	enc := make([][]byte, len(regions))
	for i, r := range regions {
		sizes[i] = r.Size
		if enc[i], err = r.MarshalBinary(); err != nil {
			return invalid(err.Error())
		}
	}
	starts, span, err := bundle.SourceStarts(sizes)
	if err != nil {
		return invalid(err.Error())
	}
	m := &bundle.Manifest{Metadata: metadata}
	for _, t := range tensors {
		n, err := bundle.ByteSize(t.DType, t.Shape)
		if err != nil {
			return invalid(fmt.Sprintf("tensor %q: %v", t.Name, err))
		}
		shape := t.Shape
		if shape == nil {
			shape = []int64{}
		}
		at := span // an empty tensor: anywhere inside, at the end
		if n > 0 {
			j := sort.Search(len(bases), func(i int) bool { return bases[i] > t.Ptr }) - 1
			at = starts[j] + int64(t.Ptr-bases[j])
		}
		m.Tensors = append(m.Tensors, bundle.Tensor{Name: t.Name, DType: t.DType, Shape: shape, Begin: at, End: at + n})
	}
	if err := m.Check(span); err != nil {
		return invalid(err.Error())
	}
	header := m.Marshal()
	if _, err := bundle.Parse(header); err != nil { // overlapping or repeated tensors
		return invalid(err.Error())
	}
	return c.publishSources(ctx, name, header, bundle.EncodeSources(enc), files, span, regions[0].Device.String(), opts)
}

// exportAllocations exports the allocations the tensors lie in, in address
// order: a cudaMalloc allocation whole, a run of adjacent VMM allocations
// as one region over them. It returns the regions, their descriptors in
// order, and each region's first address.
func exportAllocations(dev *cudaipc.Device, tensors []NoCopyTensor) (regions []cudaipc.Region, files []*os.File, bases []cudaipc.DevicePtr, err error) {
	type span struct{ base, end cudaipc.DevicePtr }
	var allocs []span
	for _, t := range tensors {
		n, err := bundle.ByteSize(t.DType, t.Shape)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("tensor %q: %v", t.Name, err)
		}
		for p, end := t.Ptr, t.Ptr+cudaipc.DevicePtr(n); n > 0 && p < end; {
			i := sort.Search(len(allocs), func(i int) bool { return allocs[i].end > p })
			if i < len(allocs) && allocs[i].base <= p {
				p = allocs[i].end
				continue
			}
			pi, err := dev.PointerInfo(p)
			if err != nil {
				return nil, nil, nil, fmt.Errorf("tensor %q at %#x: %v", t.Name, uint64(p), err)
			}
			allocs = slices.Insert(allocs, i, span{pi.Base, pi.Base + cudaipc.DevicePtr(pi.Size)})
			p = pi.Base + cudaipc.DevicePtr(pi.Size)
		}
	}
	defer func() {
		if err != nil {
			closeFiles(files)
		}
	}()
	for i := 0; i < len(allocs); {
		// Adjacent allocations export as one region when they are VMM
		// memory (ExportPointer walks them); cudaMalloc ones each alone.
		j := i + 1
		for j < len(allocs) && allocs[j].base == allocs[j-1].end {
			j++
		}
		r, fs, err := cudaipc.ExportPointer(dev, allocs[i].base, int64(allocs[j-1].end-allocs[i].base))
		if err != nil && j > i+1 {
			j = i + 1 // legacy allocations that happen to be adjacent
			r, fs, err = cudaipc.ExportPointer(dev, allocs[i].base, int64(allocs[i].end-allocs[i].base))
		}
		if err != nil {
			return nil, files, nil, err
		}
		regions, files, bases = append(regions, r), append(files, fs...), append(bases, allocs[i].base)
		i = j
	}
	return regions, files, bases, nil
}

// publishSources creates, writes and seals a no-copy version of name:
// manifest header, sources table (whose vmm-fd pieces' descriptors are
// files, in order: staged beyond one packet's), span bytes on device. The
// caller keeps and closes files.
func (c *Client) publishSources(ctx context.Context, name string, header, table []byte, files []*os.File, span int64, device string, opts CreateOptions) (uint64, error) {
	req := &storev1.CreateRequest{Name: name, Size: uint64(span), Device: device, Shared: opts.Shared, Versioned: true,
		KeepLast: uint32(max(opts.KeepLast, 0)), ManifestSize: uint64(len(header)), SourcesSize: uint64(len(table)), Files: uint32(len(files))}
	if v, ok, err := c.republish(ctx, name, req, header, table, len(files)); ok || err != nil {
		return v, err
	}
	c.registerMu.Lock()
	for len(files) > protocol.MaxFiles {
		stage := &storev1.Request{Body: &storev1.Request_StageFiles{StageFiles: &storev1.StageFilesRequest{}}}
		if _, err := c.roundTripFiles(ctx, "publish", name, stage, files[:protocol.MaxFiles]); err != nil {
			c.registerMu.Unlock()
			return 0, err
		}
		files = files[protocol.MaxFiles:]
	}
	rep, err := c.roundTripFiles(ctx, "publish", name, &storev1.Request{Body: &storev1.Request_Create{Create: req}}, files)
	c.registerMu.Unlock()
	if err != nil {
		return 0, err
	}
	cr := rep.resp.GetCreate()
	v := cr.GetVersion()
	closeFiles(rep.files)
	mf := rep.manifest
	if mf == nil || !cr.GetPlacement().GetExternal() {
		if mf != nil {
			mf.Close()
		}
		c.cleanup(reply{resp: rep.resp}, name)
		return 0, &Error{Op: "publish", Name: name, Err: ErrInternal, Message: "the daemon answered a no-copy create without its manifest memfd"}
	}
	_, err = mf.WriteAt(append(append(make([]byte, 0, len(header)+len(table)), header...), table...), 0)
	mf.Close()
	if err != nil {
		c.cleanup(reply{resp: rep.resp}, name)
		return 0, &Error{Op: "publish", Name: name, Err: ErrInternal, Message: "writing the manifest: " + err.Error()}
	}
	seal := &storev1.Request{Body: &storev1.Request_Seal{Seal: &storev1.SealRequest{Name: name, Version: v}}}
	if _, err := c.roundTrip(ctx, "publish", name, seal); err != nil {
		return 0, err
	}
	c.sentNoCopy(name, v, header, table, len(files))
	return v, nil
}

// noCopySent is the last no-copy version a client published under a name
// without descriptors, and its bytes: a next version of the very same
// bytes (the same tensors over the same allocations) is a republish.
type noCopySent struct {
	version       uint64
	header, table []byte
}

// sentNoCopy records version v of name as the one a republish may name.
func (c *Client) sentNoCopy(name string, v uint64, header, table []byte, files int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if files != 0 {
		delete(c.noCopy, name)
		return
	}
	if c.noCopy == nil {
		c.noCopy = make(map[string]noCopySent)
	}
	c.noCopy[name] = noCopySent{version: v, header: header, table: table}
}

// republish publishes a no-copy version whose header and table are those
// of the last one this client published under name, byte for byte, as one
// create that names it (CreateRequest.like_version, docs/protocol.md 6.8):
// the daemon shares that version's sealed memfd and seals at once. ok is
// false where it does not apply, or the daemon refused it (that version is
// not the last it kept for this connection): the caller publishes afresh.
func (c *Client) republish(ctx context.Context, name string, req *storev1.CreateRequest, header, table []byte, files int) (uint64, bool, error) {
	c.mu.Lock()
	last, ok := c.noCopy[name]
	c.mu.Unlock()
	if !ok || files != 0 || !bytes.Equal(last.header, header) || !bytes.Equal(last.table, table) {
		return 0, false, nil
	}
	like := proto.Clone(req).(*storev1.CreateRequest)
	like.LikeVersion = last.version
	rep, err := c.roundTrip(ctx, "publish", name, &storev1.Request{Body: &storev1.Request_Create{Create: like}})
	if errors.Is(err, ErrNotFound) || errors.Is(err, ErrInvalid) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, err
	}
	v := rep.resp.GetCreate().GetVersion()
	if rep.manifest != nil || rep.resp.GetCreate().GetManifestAttached() {
		// A daemon that does not know like_version: a plain create, which
		// the bytes complete.
		mf := rep.manifest
		if mf == nil {
			c.cleanup(reply{resp: rep.resp}, name)
			return 0, false, &Error{Op: "publish", Name: name, Err: ErrInternal, Message: "the daemon answered a no-copy create without its manifest memfd"}
		}
		_, err = mf.WriteAt(append(append(make([]byte, 0, len(header)+len(table)), header...), table...), 0)
		mf.Close()
		if err != nil {
			c.cleanup(reply{resp: rep.resp}, name)
			return 0, false, &Error{Op: "publish", Name: name, Err: ErrInternal, Message: "writing the manifest: " + err.Error()}
		}
		seal := &storev1.Request{Body: &storev1.Request_Seal{Seal: &storev1.SealRequest{Name: name, Version: v}}}
		if _, err := c.roundTrip(ctx, "publish", name, seal); err != nil {
			return 0, false, err
		}
	}
	c.sentNoCopy(name, v, header, table, 0)
	c.mu.Lock()
	c.republished++
	c.mu.Unlock()
	return v, true, nil
}

// sourcesLease completes the get of a version published without a copy:
// its sources table (after the manifest in the memfd) and all its
// descriptors, kept for Sources.
func (c *Client) sourcesLease(ctx context.Context, l *Lease, r reply, p *storev1.Placement) (*Lease, error) {
	files := r.files
	if n := int(p.GetFiles()); n > len(files) {
		var err error
		if files, err = c.moreFiles(ctx, l.info.Name, l.id, files, n); err != nil {
			c.cleanup(reply{resp: r.resp, manifest: r.manifest}, l.info.Name) // releases the lease
			return nil, err
		}
	}
	table := make([]byte, l.info.SourcesSize)
	var err error
	if r.manifest == nil {
		err = fmt.Errorf("no manifest memfd")
	} else {
		_, err = r.manifest.ReadAt(table, l.info.ManifestSize)
	}
	if err != nil {
		closeFiles(files)
		c.cleanup(reply{resp: r.resp, manifest: r.manifest}, l.info.Name)
		return nil, &Error{Op: "get", Name: l.info.Name, Err: ErrInternal, Message: "reading the sources table: " + err.Error()}
	}
	l.src = &leaseSources{table: table, files: files}
	l.v.open = false
	return l, nil
}

// Source is one region of a version published without a copy, mapped
// read-only: the version's bytes [Start, Start+Region.Size) are
// Mapping's.
type Source struct {
	Start   int64
	Region  cudaipc.Region
	Mapping *cudaipc.Mapping
}

// leaseSources is what a lease of a no-copy version holds: its sources
// table and descriptors until Sources maps them.
type leaseSources struct {
	table   []byte
	files   []*os.File
	sources []Source
	err     error
}

func (ls *leaseSources) close() error {
	closeFiles(ls.files)
	ls.files = nil
	var first error
	for _, s := range ls.sources {
		if err := s.Mapping.Close(); err != nil && first == nil {
			first = err
		}
	}
	ls.sources = nil
	return first
}

// Sources maps the regions of a version published without a copy (the
// lease's ObjectInfo.SourcesSize is not 0), once per lease; the manifest's
// offsets (Manifest) lie in them: a tensor at Begin is at Mapping.Ptr() +
// (Begin - Start) of the source whose range holds it. The mappings go with
// Release.
func (l *Lease) Sources() ([]Source, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	ls := l.src
	switch {
	case l.released:
		return nil, &Error{Op: "get", Name: l.info.Name, Err: ErrClosed, Message: "the lease was released"}
	case ls == nil:
		return nil, &Error{Op: "get", Name: l.info.Name, Err: ErrInvalid, Message: "not a version published without a copy"}
	case ls.sources != nil || ls.err != nil:
		return ls.sources, ls.err
	}
	ls.sources, ls.err = mapSources(l.info.Name, ls.table, ls.files)
	closeFiles(ls.files)
	ls.files = nil
	return ls.sources, ls.err
}

func mapSources(name string, table []byte, files []*os.File) ([]Source, error) {
	bad := func(format string, a ...any) ([]Source, error) {
		return nil, &Error{Op: "get", Name: name, Err: ErrInternal, Message: "the daemon's sources table: " + fmt.Sprintf(format, a...)}
	}
	entries, err := bundle.DecodeSources(table)
	if err != nil {
		return bad("%v", err)
	}
	regions := make([]cudaipc.Region, len(entries))
	sizes := make([]int64, len(entries))
	for i, b := range entries {
		if regions[i], err = cudaipc.DecodeRegion(b); err != nil {
			return bad("region %d: %v", i, err)
		}
		sizes[i] = regions[i].Size
	}
	starts, _, err := bundle.SourceStarts(sizes)
	if err != nil {
		return bad("%v", err)
	}
	var out []Source
	fail := func(err error) ([]Source, error) {
		for _, s := range out {
			s.Mapping.Close()
		}
		return nil, err
	}
	for i, r := range regions {
		var fs []*os.File
		if r.Kind == cudaipc.KindVMMFD {
			n := len(r.Pieces())
			if n > len(files) {
				return fail(&Error{Op: "get", Name: name, Err: ErrInternal, Message: "the version's vmm-fd regions have more pieces than descriptors came"})
			}
			fs, files = files[:n], files[n:]
		}
		m, err := importRegion(r, fs, false)
		if err != nil {
			return fail(&Error{Op: "get", Name: name, Err: fmt.Errorf("mapping region %d of a version published without a copy: %w", i, err),
				Message: "legacy regions open only in the publisher's PID namespace and while it lives"})
		}
		out = append(out, Source{Start: starts[i], Region: r, Mapping: m})
	}
	return out, nil
}
