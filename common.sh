cmp () 
{ 
    python3 - "$@" <<'EOF'
import csv,sys
def rd(p): return {int(r['step']):r for r in csv.DictReader(open(p))}
a=rd(sys.argv[1]); b=rd(sys.argv[2])
for s in sorted(b):
    if s in a:
        out=[]
        for k in ('tokens_seen','train_loss','val_loss','lr','grad_norm','epoch'):
            x,y=a[s].get(k,''),b[s].get(k,'')
            if x and y:
                if abs(float(x)-float(y))>1e-5*max(1,abs(float(x))): out.append(f"{k}: {x} vs {y}")
            elif x!=y: out.append(f"{k}: '{x}' vs '{y}'")
        print(s, 'OK' if not out else out)
    else: print(s,'only in resumed')
EOF

}
