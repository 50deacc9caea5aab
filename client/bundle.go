package client

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"

	"github.com/cudaipc/cudaipc/bundle"
)

// A bundle is one object holding many tensors, each at a 256-byte-aligned
// offset, with a manifest in the safetensors header format (package
// bundle). The manifest travels beside the object, not in it: the daemon
// keeps it in a sealed memfd and passes it with every lease, so reading
// it never touches the object's (GPU) memory and its size is not bound
// by the protocol's packet limit (docs/protocol.md, section 6.3).

// TensorData is a tensor for PutBundle: its spec and its bytes.
type TensorData struct {
	bundle.Spec
	Data []byte
}

// CreateBundle lays out the tensors of specs (bundle.Layout: in order,
// each at a multiple of bundle.Alignment) and creates an object for them
// with their manifest. Write each tensor at its manifest's Begin (WriteAt,
// or on the device at Ptr()+Begin), then Seal. For a version of a
// versioned name, set opts.Versioned (or use Publish's options).
func (c *Client) CreateBundle(ctx context.Context, name string, specs []bundle.Spec, metadata map[string]string, opts CreateOptions) (*Object, *bundle.Manifest, error) {
	m, size, err := bundle.Layout(specs, bundle.Alignment, metadata)
	if err != nil {
		return nil, nil, &Error{Op: "create", Name: name, Err: ErrInvalid, Message: err.Error()}
	}
	size = max(size, 1) // a bundle of empty tensors still needs an object
	opts.Manifest = m.Marshal()
	o, err := c.Create(ctx, name, size, opts)
	if err != nil {
		return nil, nil, err
	}
	return o, m, nil
}

// PutBundle creates a bundle of tensors, writes their bytes and seals it.
// Each tensor's Data must be exactly its spec's size.
func (c *Client) PutBundle(ctx context.Context, name string, tensors []TensorData, metadata map[string]string, opts CreateOptions) (*bundle.Manifest, error) {
	specs := make([]bundle.Spec, len(tensors))
	for i, t := range tensors {
		n, err := bundle.ByteSize(t.DType, t.Shape)
		if err != nil {
			return nil, &Error{Op: "create", Name: name, Err: ErrInvalid, Message: fmt.Sprintf("tensor %q: %v", t.Name, err)}
		}
		if int64(len(t.Data)) != n {
			return nil, &Error{Op: "create", Name: name, Err: ErrInvalid, Message: fmt.Sprintf("tensor %q: %d bytes of data, %s %v needs %d", t.Name, len(t.Data), t.DType, t.Shape, n)}
		}
		specs[i] = t.Spec
	}
	o, m, err := c.CreateBundle(ctx, name, specs, metadata, opts)
	if err != nil {
		return nil, err
	}
	begin := make(map[string]int64, len(m.Tensors))
	for _, t := range m.Tensors {
		begin[t.Name] = t.Begin
	}
	for _, t := range tensors {
		if len(t.Data) == 0 {
			continue
		}
		if _, err := o.WriteAt(t.Data, begin[t.Name]); err != nil {
			o.Abort(context.WithoutCancel(ctx))
			return nil, err
		}
	}
	if err := o.Seal(ctx); err != nil {
		return nil, err
	}
	return m, nil
}

// GetBundle leases a bundle (a version of it, with opts) and returns its
// manifest, read without touching the object's memory. With
// opts.Tensors, the manifest holds just those tensors: over the whole
// bundle's lease where the daemon holds it, else over a lease of a partial
// replica that holds only them (Lease.Info().Partial; docs/cluster.md,
// "Partial reads"). Either way each tensor's bytes are at its manifest's
// Begin in the lease.
func (c *Client) GetBundle(ctx context.Context, name string, opts GetOptions) (*Lease, *bundle.Manifest, error) {
	l, err := c.getWith(ctx, name, opts, len(opts.Tensors) > 0)
	if err != nil {
		return nil, nil, err
	}
	m, err := l.Manifest()
	if err == nil && len(opts.Tensors) > 0 {
		m, err = subset(m, opts.Tensors)
		if err != nil {
			err = &Error{Op: "get", Name: name, Err: ErrInvalid, Message: err.Error()}
		}
	}
	if err != nil {
		l.Release()
		return nil, nil, err
	}
	return l, m, nil
}

// subset returns a manifest of m's tensors named in names (in m's order),
// with m's metadata; an unknown or repeated name is an error naming it.
func subset(m *bundle.Manifest, names []string) (*bundle.Manifest, error) {
	want := make(map[string]bool, len(names))
	for _, n := range names {
		if want[n] {
			return nil, fmt.Errorf("tensor %q is named twice", n)
		}
		want[n] = true
	}
	out := &bundle.Manifest{Tensors: make([]bundle.Tensor, 0, len(names)), Metadata: m.Metadata}
	for _, t := range m.Tensors {
		if want[t.Name] {
			out.Tensors = append(out.Tensors, t)
			delete(want, t.Name)
		}
	}
	for _, n := range names {
		if want[n] {
			return nil, fmt.Errorf("the bundle has no tensor %q", n)
		}
	}
	return out, nil
}

// ErrNotBundle is returned by Lease.Manifest for an object without one.
var ErrNotBundle = errors.New("object is not a bundle (it has no manifest)")

// leaseManifest is a lease's manifest memfd, read on first use.
type leaseManifest struct {
	mu   sync.Mutex
	file *os.File
	raw  []byte
	m    *bundle.Manifest
	err  error
}

func (lm *leaseManifest) close() {
	lm.mu.Lock()
	defer lm.mu.Unlock()
	if lm.file != nil {
		lm.file.Close()
		lm.file = nil
	}
}

func (lm *leaseManifest) load(size int64) {
	if lm.raw != nil || lm.err != nil {
		return
	}
	if lm.file == nil {
		lm.err = ErrNotBundle
		return
	}
	raw := make([]byte, size)
	if _, err := lm.file.ReadAt(raw, 0); err != nil {
		lm.err = fmt.Errorf("%w: reading the manifest: %v", ErrInternal, err)
		return
	}
	lm.file.Close()
	lm.file = nil
	lm.raw = raw
}

// ManifestBytes returns the bundle's manifest as the daemon holds it: a
// safetensors header (JSON, padded with spaces), byte for byte what its
// creator wrote. It fails with ErrNotBundle for a plain object.
func (l *Lease) ManifestBytes() ([]byte, error) {
	l.bundle.mu.Lock()
	defer l.bundle.mu.Unlock()
	l.bundle.load(l.info.ManifestSize)
	return l.bundle.raw, l.bundle.err
}

// Manifest returns the bundle's manifest, decoded: the tensors sorted by
// offset, each Begin and End relative to the object's first byte (add
// Ptr() on the device, or index Bytes() on the host).
func (l *Lease) Manifest() (*bundle.Manifest, error) {
	raw, err := l.ManifestBytes()
	if err != nil {
		return nil, err
	}
	l.bundle.mu.Lock()
	defer l.bundle.mu.Unlock()
	if l.bundle.m == nil {
		m, err := bundle.Parse(raw)
		if err == nil {
			err = m.Check(l.info.Size)
		}
		if err != nil {
			return nil, &Error{Op: "get", Name: l.info.Name, Err: ErrInternal, Message: "the daemon's manifest: " + err.Error()}
		}
		l.bundle.m = m
	}
	return l.bundle.m, nil
}
