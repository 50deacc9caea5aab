package client_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"

	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/client"
)

func init() {
	// Gets the latest version of bundle NAME (COUNT tensors, each
	// stream(VERSION, tensor name)) and checks every tensor with ReadAt;
	// says "ok VERSION".
	gpuRoles["gpu-bundle-reader"] = func(ctx context.Context, c *client.Client, say func(string, ...any)) error {
		l, m, err := c.GetBundle(ctx, os.Getenv("NAME"), client.GetOptions{})
		if err != nil {
			return err
		}
		defer l.Release()
		if len(m.Tensors) != envInt("COUNT") || l.Ptr() == 0 {
			return fmt.Errorf("%d tensors, ptr %#x", len(m.Tensors), l.Ptr())
		}
		v := l.Info().Version
		for _, tn := range m.Tensors {
			got := make([]byte, tn.Size())
			if _, err := l.ReadAt(got, tn.Begin); err != nil {
				return err
			}
			if !bytes.Equal(got, stream(v, tn.Name, int(tn.Size()))) {
				return fmt.Errorf("version %d: tensor %s differs", v, tn.Name)
			}
		}
		say("ok %d", v)
		return nil
	}
}

// GPU bundles published version after version, read by another process
// with the manifest beside the lease, by legacy IPC and by descriptor; a
// superseded version's memory serves the next one.
func TestGPUBundleVersions(t *testing.T) {
	for _, share := range []string{"ipc", "fd"} {
		t.Run(share, func(t *testing.T) {
			d, _ := startGPUDaemon(t, "GPU_SHARE="+share)
			c := dial(t, d.socket)
			ctx := context.Background()
			const n = 300
			specs := make([]bundle.Spec, n)
			for i := range specs {
				specs[i] = bundle.Spec{Name: fmt.Sprintf("layers.%d.w", i), DType: bundle.DTypes[i%len(bundle.DTypes)], Shape: []int64{int64(1 + i%5), 64}}
			}
			var regions []string
			for v := uint64(1); v <= 3; v++ {
				o, m, err := c.CreateBundle(ctx, "gpu-bundle", specs, nil, client.CreateOptions{Device: "0", Versioned: true})
				if err != nil {
					t.Fatal(err)
				}
				if o.Version() != v || o.Ptr() == 0 {
					t.Fatalf("version %d, ptr %#x", o.Version(), o.Ptr())
				}
				for _, tn := range m.Tensors {
					if _, err := o.WriteAt(stream(v, tn.Name, int(tn.Size())), tn.Begin); err != nil {
						t.Fatal(err)
					}
				}
				if err := o.Seal(ctx); err != nil {
					t.Fatal(err)
				}
				r := spawn(t, "gpu-bundle-reader", nil, "CUDAIPC_SOCKET="+d.socket, "NAME=gpu-bundle", "COUNT="+strconv.Itoa(n))
				if got := r.expect("ok "); got != strconv.FormatUint(v, 10) {
					t.Fatalf("reader read version %s, want %d", got, v)
				}
				info, err := c.Stat(ctx, "gpu-bundle")
				if err != nil || info.Tensors != n {
					t.Fatalf("stat: %v %+v", err, info)
				}
				if info.Region != nil {
					regions = append(regions, fmt.Sprintf("%+v", *info.Region))
				}
			}
			// Version 3 took version 1's memory: the same region.
			if share == "ipc" && (len(regions) != 3 || regions[2] != regions[0] || regions[1] == regions[0]) {
				t.Errorf("regions of versions 1, 2, 3: %q", regions)
			}
		})
	}
}
