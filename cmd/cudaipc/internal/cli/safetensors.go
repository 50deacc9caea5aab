package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/bytesize"
)

// bundleChunk is the staging buffer of a safetensors put: a file streams
// through it (pinned host memory for a GPU bundle), never held whole.
const bundleChunk = 64 << 20

// isSafetensors reports whether put's FILE is to be loaded as a bundle: a
// .safetensors file, or a directory of them.
func isSafetensors(path string) bool {
	if strings.HasSuffix(path, ".safetensors") {
		return true
	}
	st, err := os.Stat(path)
	return err == nil && st.IsDir()
}

// stFile is one safetensors file being loaded.
type stFile struct {
	path      string
	f         *os.File
	header    []byte
	dataStart int64
	dataSize  int64
	m         *bundle.Manifest
}

func openST(path string) (*stFile, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	h, start, err := bundle.ReadHeader(f)
	if err == nil && start > st.Size() {
		err = fmt.Errorf("%w: header runs past the end of the file", bundle.ErrInvalid)
	}
	var m *bundle.Manifest
	if err == nil {
		m, err = bundle.Parse(h)
	}
	if err == nil {
		err = m.Check(st.Size() - start)
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &stFile{path: path, f: f, header: h, dataStart: start, dataSize: st.Size() - start, m: m}, nil
}

// safetensorsInputs opens a .safetensors file, or the shards of a
// directory: those its model.safetensors.index.json names, else every
// *.safetensors file in it, in name order. meta is the index's metadata.
func safetensorsInputs(path string) (files []*stFile, meta map[string]string, err error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, nil, err
	}
	var paths []string
	if !st.IsDir() {
		paths = []string{path}
	} else if idx, err := os.ReadFile(filepath.Join(path, "model.safetensors.index.json")); err == nil {
		var index struct {
			Metadata  map[string]any    `json:"metadata"`
			WeightMap map[string]string `json:"weight_map"`
		}
		if err := json.Unmarshal(idx, &index); err != nil {
			return nil, nil, fmt.Errorf("%s: model.safetensors.index.json: %w", path, err)
		}
		seen := map[string]bool{}
		for _, shard := range index.WeightMap {
			if !seen[shard] && !strings.Contains(shard, "/") {
				seen[shard] = true
				paths = append(paths, filepath.Join(path, shard))
			}
		}
		sort.Strings(paths)
		if len(index.Metadata) > 0 {
			meta = map[string]string{}
			for k, v := range index.Metadata {
				if s, ok := v.(string); ok {
					meta[k] = s
				} else {
					j, _ := json.Marshal(v)
					meta[k] = string(j)
				}
			}
		}
	} else {
		paths, _ = filepath.Glob(filepath.Join(path, "*.safetensors"))
		sort.Strings(paths)
	}
	if len(paths) == 0 {
		return nil, nil, fmt.Errorf("%s has no .safetensors files", path)
	}
	for _, p := range paths {
		f, err := openST(p)
		if err != nil {
			closeST(files)
			return nil, nil, err
		}
		files = append(files, f)
	}
	return files, meta, nil
}

func closeST(files []*stFile) {
	for _, f := range files {
		f.f.Close()
	}
}

// putSafetensors loads safetensors into a new bundle. A single file whose
// tensors already lie at 256-byte multiples is stored as it is (its
// header verbatim as the manifest, its data section as the object), so
// that 'get -o' gives the same bytes back; anything else is laid out anew,
// tensor by tensor.
func (c *putCmd) putSafetensors(g *Globals) error {
	files, meta, err := safetensorsInputs(c.File)
	if err != nil {
		return err
	}
	defer closeST(files)
	cl, err := g.dial()
	if err != nil {
		return err
	}
	defer cl.Close()
	ctx := g.Context()
	opts := client.CreateOptions{Device: c.Device, Shared: c.Shared, Versioned: c.Publish, Cluster: c.Cluster}

	type copyOp struct {
		f        *stFile
		src, dst int64 // file offset, object offset
		n        int64
	}
	var ops []copyOp
	var size int64
	var tensors int
	if len(files) == 1 && files[0].m.Aligned(bundle.Alignment) && files[0].dataSize > 0 {
		f := files[0]
		opts.Manifest = f.header
		size = f.dataSize
		ops = []copyOp{{f, f.dataStart, 0, f.dataSize}}
		tensors = len(f.m.Tensors)
	} else {
		var specs []bundle.Spec
		for _, f := range files {
			for _, t := range f.m.Tensors {
				specs = append(specs, bundle.Spec{Name: t.Name, DType: t.DType, Shape: t.Shape})
			}
			if len(files) == 1 && meta == nil {
				meta = f.m.Metadata
			}
		}
		m, n, err := bundle.Layout(specs, bundle.Alignment, meta)
		if err != nil {
			return fmt.Errorf("%s: %w", c.File, err)
		}
		at := make(map[string]int64, len(m.Tensors))
		for _, t := range m.Tensors {
			at[t.Name] = t.Begin
		}
		for _, f := range files {
			for _, t := range f.m.Tensors {
				if t.Size() > 0 {
					ops = append(ops, copyOp{f, f.dataStart + t.Begin, at[t.Name], t.Size()})
				}
			}
		}
		opts.Manifest = m.Marshal()
		size = max(n, 1)
		tensors = len(m.Tensors)
	}
	obj, err := cl.Create(ctx, c.Name, size, opts)
	if err != nil {
		return explain(err, g.socketPath())
	}
	var total int64
	for _, op := range ops {
		total += op.n
	}
	bar := newProgress(g.stderr, total, "put "+c.Name)
	err = func() error {
		buf, free, err := stagingBuffer(obj, min(bundleChunk, max(total, 1)))
		if err != nil {
			return err
		}
		defer free()
		dst := obj.Bytes()
		for _, op := range ops {
			for done := int64(0); done < op.n; {
				if err := ctx.Err(); err != nil {
					return context.Cause(ctx)
				}
				k := min(int64(bundleChunk), op.n-done)
				if dst == nil {
					k = min(int64(len(buf)), k)
				}
				var chunk []byte
				if dst != nil { // host: read straight into the object
					chunk = dst[op.dst+done : op.dst+done+k]
				} else {
					chunk = buf[:k]
				}
				if _, err := op.f.f.ReadAt(chunk, op.src+done); err != nil {
					return fmt.Errorf("reading %s: %w", op.f.path, err)
				}
				if dst == nil {
					if _, err := obj.WriteAt(chunk, op.dst+done); err != nil {
						return err
					}
				}
				done += k
				progressAdd(bar, int(k))
			}
		}
		return nil
	}()
	progressDone(bar)
	if err != nil {
		_ = obj.Abort(context.WithoutCancel(ctx))
		return fmt.Errorf("loading %s: %w (nothing was stored)", c.File, err)
	}
	if err := obj.Seal(ctx); err != nil {
		return explain(err, g.socketPath())
	}
	v := ""
	if obj.Version() != 0 {
		v = fmt.Sprintf(" version %d", obj.Version())
	}
	fmt.Fprintf(g.stdout, "stored bundle %q%s: %d tensors, %s (%d bytes) on %s\n", c.Name, v, tensors, bytesize.Format(size), size, obj.Device())
	return nil
}

// stagingBuffer returns the buffer a GPU object is filled through: pinned
// host memory, so that each chunk goes to the device by DMA at full speed
// (pageable memory when pinning fails), or nil for a host object, which is
// filled in place.
func stagingBuffer(obj *client.Object, n int64) ([]byte, func(), error) {
	if obj.Bytes() != nil {
		return nil, func() {}, nil
	}
	if d := obj.CUDADevice(); d != nil {
		if h, err := d.AllocHost(n); err == nil {
			return h.Bytes(), func() { h.Free() }, nil
		}
	}
	return make([]byte, n), func() {}, nil
}

// writeBundle writes a leased bundle as a safetensors file. A bundle whose
// tensors cover it densely is written as its manifest and bytes verbatim
// (byte-identical to the file it was put from); one with padding between
// tensors gets a dense header and its tensors one after the other.
func writeBundle(ctx context.Context, w io.Writer, l *client.Lease, progress func(int)) error {
	return writeTensors(ctx, w, l, nil, progress)
}

// writeTensors is writeBundle of the tensors of m (a subset of the lease's
// manifest, from GetBundle), or of all of them (m nil).
func writeTensors(ctx context.Context, w io.Writer, l *client.Lease, m *bundle.Manifest, progress func(int)) error {
	raw, err := l.ManifestBytes()
	if err != nil {
		return err
	}
	whole := m == nil
	if whole {
		if m, err = l.Manifest(); err != nil {
			return err
		}
	}
	if whole && m.Dense() && m.DataSize() == l.Size() {
		if err := bundle.WriteHeader(w, raw); err != nil {
			return err
		}
		return writeLease(ctx, w, l, progress)
	}
	c, _ := m.Compact()
	if err := bundle.WriteHeader(w, c.Marshal()); err != nil {
		return err
	}
	order := slices.Clone(m.Tensors) // sorted by Begin, as c is
	var buf []byte
	for _, t := range order {
		if b := l.Bytes(); b != nil {
			if err := writeAll(ctx, w, b[t.Begin:t.End], progress); err != nil {
				return err
			}
			continue
		}
		for off := t.Begin; off < t.End; {
			if buf == nil {
				buf = make([]byte, copyChunk)
			}
			n := min(int64(len(buf)), t.End-off)
			if _, err := l.ReadAt(buf[:n], off); err != nil {
				return fmt.Errorf("reading %q from the GPU: %w", l.Info().Name, err)
			}
			if err := writeAll(ctx, w, buf[:n], progress); err != nil {
				return err
			}
			off += n
		}
	}
	return nil
}
