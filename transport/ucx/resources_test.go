package ucx

import (
	"slices"
	"testing"
)

// What ucp_context_print_info printed with UCX 1.13.1 (UCX_TLS=tcp,sm,self).
const printInfo113 = `#
# UCP context
#
#     component 0  :  self
#     component 1  :  tcp
#     component 2  :  sysv
#     component 3  :  posix
#
#            md 0  :  component 0  self 
#            md 1  :  component 1  tcp 
#            md 2  :  component 2  sysv 
#
#      resource 0  :  md 0  dev 0  flags -- self/memory
#      resource 1  :  md 1  dev 1  flags -- tcp/lo
#      resource 2  :  md 1  dev 2  flags -s tcp/eth0
#      resource 3  :  md 2  dev 3  flags -- sysv/memory
#
`

func TestParseResources(t *testing.T) {
	got := parseResources(printInfo113)
	want := []Resource{{"self", "memory"}, {"tcp", "lo"}, {"tcp", "eth0"}, {"sysv", "memory"}}
	if !slices.Equal(got, want) {
		t.Fatalf("parseResources = %v, want %v", got, want)
	}
	if got := parseResources("garbage\n# resource x\n"); len(got) != 0 {
		t.Fatalf("parsed %v from garbage", got)
	}
}
